-- Migration 8 (pgque 0.6.0): the pause failure policy.
--
-- A consumer group chooses what a failed event does to its key: 'skip' (the
-- event goes to the retry queue, the key moves on) or 'pause' (no later event
-- of the key is handed out until the failed one is handled or dead-lettered).
-- A paused key has one marker, pgque.blocked_key; the events of the key that
-- its slot reads while it is blocked are set aside, in order, in
-- pgque.held_event, and handed out from there once the key is released (see
-- code/slots/pause.sql). Existing groups keep 'skip'.

alter table pgque.consumer_group
    add column if not exists cg_policy text not null default 'skip',
    add column if not exists cg_max_attempts integer,
    add column if not exists cg_pause_timeout interval,
    add column if not exists cg_max_retries integer;  -- null: the queue's max_retries

do $policy$
begin
    if not exists (select from pg_catalog.pg_constraint
                    where conname = 'consumer_group_policy_check'
                      and conrelid = 'pgque.consumer_group'::pg_catalog.regclass) then
        alter table pgque.consumer_group add constraint consumer_group_policy_check
            check (cg_policy in ('skip', 'pause')
                   and (cg_max_attempts is null or cg_max_attempts >= 1)
                   and (cg_pause_timeout is null or cg_pause_timeout > interval '0')
                   and (cg_max_retries is null or cg_max_retries >= 0));
    end if;
end
$policy$;

-- One row per blocked key of a slot subscription. Written when the key's
-- event fails, at each later failure of its head, when a piece of its held
-- events is handed out and acked, and by the ledger's verbs; deleted once its
-- held events are all handled. Nothing here is written for a key that is not
-- blocked.
create table if not exists pgque.blocked_key (
    bk_sub          integer not null references pgque.subscription on delete cascade,
    bk_key          text not null,
    -- The slot's own reads hold the key's events after this point of its log:
    -- in a later batch, or in this batch after this event.
    bk_from_batch   bigint not null,
    bk_from_ev      bigint not null,
    -- The held events of the key with he_seq above this are still to be
    -- handled; the first of them is the head, the one that failed.
    bk_done_seq     bigint not null,
    bk_attempts     integer not null,      -- how often the head failed
    bk_retry_at     timestamptz not null,  -- when the head may be handed out again
    bk_since        timestamptz not null,  -- when the head first failed
    bk_first_error  text,
    bk_last_error   text,
    bk_last_failure timestamptz,
    -- The piece of held events handed out and not acked yet: its batch id and
    -- the he_seq of its last event of this key.
    bk_batch        bigint,
    bk_handed_seq   bigint,
    bk_epoch        bigint,  -- the slot owner's epoch it was handed out under
    primary key (bk_sub, bk_key)
);
create index if not exists blocked_key_ready on pgque.blocked_key (bk_sub, bk_retry_at);
create index if not exists blocked_key_piece on pgque.blocked_key (bk_batch)
    where bk_batch is not null;

-- Orders the held events.
create sequence if not exists pgque.held_seq;

-- The held events: an event of a blocked key, set aside in order (he_seq) as
-- it was read, its retry count as it was. Never updated or deleted: a row is
-- done once its marker's bk_done_seq passed it or the marker is gone, and
-- the table rotates like the retry queue (two partitions, the one not written
-- emptied by TRUNCATE after what is still needed in it is copied over).
--
-- No foreign key to pgque.subscription: its check would share-lock the
-- subscription's row, which a worker holds (its receive lock) while it reads
-- this table, and the rotation's copy would wait for it while holding the
-- partition it empties (a deadlock). The rows of a subscription that is gone
-- have no marker, so the next rotation leaves them behind.
create table if not exists pgque.held_event (
    he_sub   integer not null,
    he_key   text not null,
    he_seq   bigint not null,
    he_batch bigint not null,  -- the batch of the slot's log it was read from
    ev_id    bigint not null,
    ev_time  timestamptz not null,
    ev_txid  xid8,
    ev_retry integer not null,
    ev_type  text,
    ev_data  text,
    he_part  smallint not null,  -- the partition (pgque.rotation 'held')
    primary key (he_sub, he_key, he_seq, he_part)
) partition by list (he_part);
create table if not exists pgque.held_event_0 partition of pgque.held_event for values in (0);
create table if not exists pgque.held_event_1 partition of pgque.held_event for values in (1);
-- A piece of the log handed out again sets aside only what it did not the first time.
create index if not exists held_event_read on pgque.held_event (he_sub, he_batch, ev_id);

-- The rotation's names gain 'held', unless they have it already: a run again
-- (a lost pgque.migration, see 0001) after a later migration added more
-- names must not narrow them.
do $names$
begin
    if not exists (select from pg_catalog.pg_constraint
                    where conname = 'rotation_rt_name_check'
                      and conrelid = 'pgque.rotation'::pg_catalog.regclass
                      and pg_catalog.pg_get_constraintdef(oid) like '%''held''%') then
        alter table pgque.rotation drop constraint if exists rotation_rt_name_check;
        alter table pgque.rotation add constraint rotation_rt_name_check
            check (rt_name in ('cursor', 'tick', 'nack', 'retry', 'held'));
    end if;
end
$names$;
insert into pgque.rotation (rt_name) values ('held') on conflict do nothing;
