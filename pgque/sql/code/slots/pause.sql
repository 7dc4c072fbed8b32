-- pgque: the pause failure policy: blocked keys and their held events.
--
-- Under 'skip' (the default) a failed event goes to the retry queue and its
-- key moves on. Under 'pause' a failed event of key K blocks K in its slot:
-- no later event of K is handed out until the failed one (the head) is
-- handled or dead-lettered; then K's held events follow in order.
--
-- The happy path writes nothing new. A blocked key is one marker row
-- (pgque.blocked_key), written at its failures and releases. While a slot has
-- markers, its receive sets the events of their keys aside, in the order it
-- reads them, into pgque.held_event (never updated or deleted; rotated and
-- emptied by TRUNCATE like the retry queue), instead of handing them out.
-- Setting an event aside does not count as a retry: its retry count stays as
-- it was, and the marker's attempts count only the head's real failures.
--
-- A key whose head is due (bk_retry_at passed) is handed out from the held
-- events: a piece with a batch id of its own, at most max_events events of
-- the due keys, before the slot's next piece of the log. Its ack moves each
-- key on past what was handled; a failure makes the failed event the head
-- again (its attempts counted) and keeps the rest held. A marker goes once
-- its key has nothing held, in the ack that handled the last event: from
-- then on the slot's reads hand the key's events out again, and every event
-- of the key they met before was set aside, so the order holds.
--
-- A slot has at most one piece handed out and not acked: its piece of the
-- log, or its piece of held events. A receive hands out the same piece again
-- until it is acked, as receive does for the log. After max_attempts
-- failures, or once the head blocked the key for pause_timeout, the head goes
-- to the dead letters and the key moves on (both per group; null: no bound).

-- pgque._has_blocked(sub_id): whether the slot subscription has a blocked key.
create or replace function pgque._has_blocked(p_sub_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.blocked_key b where b.bk_sub = p_sub_id)
$$;

-- pgque._held_due(sub_id): whether the slot subscription has a piece of held
-- events to hand out: one handed out and not acked, or a key whose head is due.
create or replace function pgque._held_due(p_sub_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    -- A key's piece is handed out only once its head is due, and nothing
    -- delays a key while its piece is out: one probe of blocked_key_ready.
    select exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub_id and b.bk_retry_at <= now())
$$;

-- pgque._log_piece_open(cur): whether the cursor's last piece of the log was
-- handed out and not acked (the receive hands it out again).
create or replace function pgque._log_piece_open(p_cur pgque.cursor)
returns boolean
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select p_cur.cur_batch is not null
           and coalesce(p_cur.cur_handed, 0) > coalesce(p_cur.cur_pos, 0)
$$;

-- pgque._is_held(sub_id, batch_id, key, ev_id): whether an event of the
-- slot's log (in batch batch_id) is held: its key is blocked from an earlier
-- point of the log.
create or replace function pgque._is_held(p_sub_id integer, p_batch_id bigint, p_key text,
                                          p_ev_id bigint)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub_id and b.bk_key = p_key
                      and (b.bk_from_batch < p_batch_id
                           or (b.bk_from_batch = p_batch_id and p_ev_id >= b.bk_from_ev)))
$$;

-- pgque._hold_events(sub_id, batch_id, events): the events of a slot's piece
-- of the log (of batch batch_id, ev_id order) without those that are held,
-- which it sets aside into pgque.held_event, in order, unless they were set
-- aside from this batch already (a piece handed out again, maybe cut
-- otherwise). The caller holds the receive lock.
create or replace function pgque._hold_events(
    p_sub_id integer, p_batch_id bigint, p_events pgque.event_template[])
returns pgque.event_template[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
    v_part smallint;
begin
    -- The piece's keys that are blocked, in one index scan: most pieces have
    -- none, and go out as they are.
    v_keys := array(select b.bk_key from pgque.blocked_key b
                     where b.bk_sub = p_sub_id
                       and b.bk_key = any (array(select distinct e.ev_extra1
                                                   from unnest(p_events) e)));
    if cardinality(v_keys) = 0 then
        return p_events;
    end if;
    v_part := pgque._write_part('held');
    insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                  ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
    select p_sub_id, h.ev_extra1, nextval('pgque.held_seq'), p_batch_id, h.ev_id, h.ev_time,
           h.ev_txid, h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_part
      from (select e.* from unnest(p_events) e
             where e.ev_extra1 = any (v_keys)
               and pgque._is_held(p_sub_id, p_batch_id, e.ev_extra1, e.ev_id)
               and not exists (select from pgque.held_event x
                                where x.he_sub = p_sub_id and x.he_batch = p_batch_id
                                  and x.ev_id = e.ev_id)
             order by e.ev_id) h;
    return array(select e from unnest(p_events) e
                  where not (e.ev_extra1 = any (v_keys)
                             and pgque._is_held(p_sub_id, p_batch_id, e.ev_extra1, e.ev_id))
                  order by e.ev_id);
end
$$;

-- pgque._receive_held(queue, group, sub, max_events, epoch, slot): the slot's
-- piece of held events, as batch_event rows: the piece handed out and not
-- acked again (to the same owner), else a new one (a new batch id) of the
-- keys whose head is due, oldest due first, each key's events in order, at
-- most max_events in all (null: every one). No rows when there is none. The
-- head of a key comes with its attempts as its retry count. A piece whose
-- owner lost the slot before its ack (another epoch now) is made anew, its
-- loss noted as the heads' last error but not counted as an attempt (a crash
-- or a restart is not the handler's failure); a head due past pause_timeout
-- goes to the dead letters without another try, which also bounds a head
-- that kills its worker every time. The caller
-- holds the receive lock and checked that the slot's piece of the log is not
-- open.
create or replace function pgque._receive_held(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_max_events integer, p_epoch bigint, p_slot integer)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_batch bigint;
    v_then bigint;
    v_marker pgque.blocked_key;
begin
    select b.bk_batch, b.bk_epoch into v_batch, v_then from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_retry_at <= now() and b.bk_batch is not null
     limit 1;
    if v_batch is not null and v_then is distinct from p_epoch then
        -- Lost with its owner: not the handler's failure (a crash, a restart),
        -- so no attempt is counted; the piece is made anew, and its heads that
        -- blocked their keys for pause_timeout go to the dead letters below.
        update pgque.blocked_key b
           set bk_batch = null, bk_handed_seq = null, bk_epoch = null,
               bk_last_error = 'lost: the session that had it ended before its ack',
               bk_last_failure = now()
         where b.bk_sub = p_sub.sub_id and b.bk_batch = v_batch;
        v_batch := null;
    end if;
    if v_batch is null then
        for v_marker in select * from pgque.blocked_key b
                         where b.bk_sub = p_sub.sub_id and b.bk_retry_at <= now()
                           and (b.bk_attempts > 0 or b.bk_last_error like 'lost: %')
                           and now() >= b.bk_since + p_group.cg_pause_timeout
                         order by b.bk_key for update loop
            perform pgque._kill_head(p_queue, p_sub, v_marker,
                                     coalesce(v_marker.bk_last_error || '; ', '')
                                     || 'pause_timeout passed');
        end loop;
        v_batch := nextval('pgque.batch_id_seq');
        with due as (
            select b.bk_key, b.bk_done_seq, b.bk_retry_at from pgque.blocked_key b
             where b.bk_sub = p_sub.sub_id and b.bk_retry_at <= now()
             order by b.bk_retry_at, b.bk_key
             limit p_max_events
        ), events as (
            select d.bk_key, h.he_seq,
                   row_number() over (order by d.bk_retry_at, d.bk_key, h.he_seq) as n
              from due d
              join pgque.held_event h
                on h.he_sub = p_sub.sub_id and h.he_key = d.bk_key and h.he_seq > d.bk_done_seq
        ), picked as (
            select e.bk_key, max(e.he_seq) as last from events e
             where p_max_events is null or e.n <= p_max_events
             group by e.bk_key
        )
        update pgque.blocked_key b set bk_batch = v_batch, bk_handed_seq = p.last,
                                       bk_epoch = p_epoch
          from picked p
         where b.bk_sub = p_sub.sub_id and b.bk_key = p.bk_key;
        if not found then
            return;
        end if;
    end if;
    return query
        select v_batch, h.ev_id, h.ev_time,
               h.ev_retry + case when h.he_seq = f.first then b.bk_attempts else 0 end,
               h.ev_type, h.ev_data, h.he_key, p_epoch, p_slot, h.ev_delayed_id
          from pgque.blocked_key b
          join pgque.held_event h
            on h.he_sub = b.bk_sub and h.he_key = b.bk_key
           and h.he_seq > b.bk_done_seq and h.he_seq <= b.bk_handed_seq
         cross join lateral (select min(x.he_seq) as first from pgque.held_event x
                              where x.he_sub = b.bk_sub and x.he_key = b.bk_key
                                and x.he_seq > b.bk_done_seq) f
         where b.bk_sub = p_sub.sub_id and b.bk_batch = v_batch
         order by b.bk_retry_at, b.bk_key, h.he_seq;
end
$$;

-- pgque._check_nack_args(batch_id, ev_ids, reasons, retry_after,
-- retry_afters, dead_ids): the checks every nack makes of its arguments: 22023
-- for a negative or null retry_after, a count of reasons that is neither one
-- nor one per id, retry_afters not one per id or with a negative one, or a
-- dead id that is not among ev_ids; PQ010 for a null id.
create or replace function pgque._check_nack_args(p_batch_id bigint, p_ev_ids bigint[],
                                                  p_reasons text[], p_retry_after interval,
                                                  p_retry_afters interval[] default null,
                                                  p_dead_ids bigint[] default null)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_retry_after is null or p_retry_after < interval '0' then
        raise exception using errcode = '22023', message = 'retry_after must not be negative';
    end if;
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return;
    end if;
    if array_position(p_ev_ids, null) is not null then
        raise exception using errcode = 'PQ010',
            message = format('nack: event id must not be null (batch %s)', p_batch_id);
    end if;
    if cardinality(p_reasons) not in (1, cardinality(p_ev_ids)) then
        raise exception using errcode = '22023',
            message = 'nack: give one reason, or one per event id';
    end if;
    if p_retry_afters is not null
       and (cardinality(p_retry_afters) <> cardinality(p_ev_ids)
            or exists (select from unnest(p_retry_afters) d where d < interval '0')) then
        raise exception using errcode = '22023',
            message = 'nack: retry_afters must be one per event id, none negative';
    end if;
    if exists (select from unnest(p_dead_ids) d where d is null or d <> all(p_ev_ids)) then
        raise exception using errcode = '22023',
            message = 'nack: every dead id must be one of the nacked event ids';
    end if;
end
$$;

-- pgque._delay_of(ev_ids, retry_afters, retry_after, ev_id): how long the
-- failed event ev_id waits before it is due again: its own of retry_afters,
-- else retry_after.
create or replace function pgque._delay_of(p_ev_ids bigint[], p_retry_afters interval[],
                                           p_retry_after interval, p_ev_id bigint)
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select coalesce(p_retry_afters[array_position(p_ev_ids, p_ev_id)], p_retry_after) $$;

-- pgque._reason_of(ev_ids, reasons, ev_id): the reason given for ev_id.
create or replace function pgque._reason_of(p_ev_ids bigint[], p_reasons text[], p_ev_id bigint)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when cardinality(p_reasons) = 1 then p_reasons[1]
                else p_reasons[array_position(p_ev_ids, p_ev_id)] end
$$;

-- pgque._fail_head(queue, group, sub, key, head_seq, reason, retry_after):
-- records a failure of the event of blocked key key at head_seq (the marker
-- exists): it becomes the head (its attempts counted on, or from 1 when it was
-- not the head yet), due again after retry_after; once it failed
-- max_attempts times, or blocked the key for pause_timeout, it goes to the
-- dead letters instead and the key moves on; so it does at once when
-- dead_now (a failure retrying cannot heal). Returns 1 when it was
-- dead-lettered, else 0. Deletes the marker when nothing is left held.
create or replace function pgque._fail_head(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription, p_key text,
    p_head_seq bigint, p_reason text, p_retry_after interval, p_dead_now boolean default false)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
begin
    select * into v_marker from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_key;
    if (select min(h.he_seq) from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = p_key
           and h.he_seq > v_marker.bk_done_seq) = p_head_seq and v_marker.bk_attempts > 0 then
        v_marker.bk_attempts := v_marker.bk_attempts + 1;  -- the head failed again
    else
        v_marker.bk_attempts := 1;
        v_marker.bk_since := now();
        v_marker.bk_first_error := p_reason;
    end if;
    v_marker.bk_done_seq := p_head_seq - 1;
    v_marker.bk_last_error := p_reason;
    v_marker.bk_last_failure := now();
    v_marker.bk_retry_at := least(now() + p_retry_after,
                                  v_marker.bk_since + p_group.cg_pause_timeout);
    if p_dead_now or v_marker.bk_attempts >= p_group.cg_max_attempts
       or now() >= v_marker.bk_since + p_group.cg_pause_timeout then
        perform pgque._kill_head(p_queue, p_sub, v_marker, p_reason);
        return 1;
    end if;
    perform pgque._save_marker(v_marker);
    return 0;
end
$$;

-- pgque._held_to_retry(queue, sub, held, reason, retry_after): a held event
-- that failed while its group has the 'skip' policy goes where a failure goes
-- under 'skip': to the retry queue, or to the dead letters once it was retried
-- max_retries times (or at once when dead_now). Returns 1 for a dead letter,
-- else 0.
create or replace function pgque._held_to_retry(
    p_queue pgque.queue, p_sub pgque.subscription, p_held pgque.held_event, p_reason text,
    p_retry_after interval, p_dead_now boolean default false)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_held.ev_retry < p_queue.queue_max_retries and not p_dead_now then
        insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                       ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id,
                                       rq_part)
        values (now() + p_retry_after, p_queue.queue_id, p_sub.sub_id, p_held.ev_id,
                p_held.ev_time, p_held.ev_retry + 1, p_held.ev_type, p_held.ev_data,
                p_held.he_key, p_held.ev_delayed_id, pgque._write_part('retry'));
        return 0;
    end if;
    insert into pgque.dead_letter (dl_queue, dl_consumer, dl_sub, dl_reason, ev_id, ev_time,
                                   ev_txid, ev_retry, ev_type, ev_data, ev_extra1)
    values (p_queue.queue_id, p_sub.sub_consumer, p_sub.sub_id, p_reason, p_held.ev_id,
            p_held.ev_time, p_held.ev_txid, p_held.ev_retry, p_held.ev_type, p_held.ev_data,
            p_held.he_key);
    return 1;
end
$$;

-- pgque._kill_head(queue, sub, marker, reason): the marker's head goes to the
-- dead letters with reason, its retry count the retries it had (its failures
-- less one), and its key moves on: what is held behind it is due now.
create or replace function pgque._kill_head(p_queue pgque.queue, p_sub pgque.subscription,
                                            p_marker pgque.blocked_key, p_reason text)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_head pgque.held_event := pgque._head_of(p_marker);
begin
    insert into pgque.dead_letter (dl_queue, dl_consumer, dl_sub, dl_reason, ev_id, ev_time,
                                   ev_txid, ev_retry, ev_type, ev_data, ev_extra1)
    values (p_queue.queue_id, p_sub.sub_consumer, p_sub.sub_id, p_reason, v_head.ev_id,
            v_head.ev_time, v_head.ev_txid,
            v_head.ev_retry + greatest(p_marker.bk_attempts - 1, 0), v_head.ev_type,
            v_head.ev_data, p_marker.bk_key);
    p_marker.bk_done_seq := v_head.he_seq;
    p_marker.bk_attempts := 0;
    p_marker.bk_retry_at := now();
    perform pgque._save_marker(p_marker);
    return v_head.ev_id;
end
$$;

-- pgque._save_marker(marker): writes a marker back with its piece closed,
-- or deletes it when its key has nothing left held.
create or replace function pgque._save_marker(p_marker pgque.blocked_key)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if not exists (select from pgque.held_event h
                    where h.he_sub = p_marker.bk_sub and h.he_key = p_marker.bk_key
                      and h.he_seq > p_marker.bk_done_seq) then
        delete from pgque.blocked_key b
         where b.bk_sub = p_marker.bk_sub and b.bk_key = p_marker.bk_key;
        return;
    end if;
    update pgque.blocked_key b
       set bk_done_seq = p_marker.bk_done_seq, bk_attempts = p_marker.bk_attempts,
           bk_retry_at = p_marker.bk_retry_at, bk_since = p_marker.bk_since,
           bk_first_error = p_marker.bk_first_error, bk_last_error = p_marker.bk_last_error,
           bk_last_failure = p_marker.bk_last_failure, bk_batch = null, bk_handed_seq = null,
           bk_epoch = null
     where b.bk_sub = p_marker.bk_sub and b.bk_key = p_marker.bk_key;
end
$$;

-- pgque._ack_held(queue, group, sub, batch_id, nack_ids, reasons,
-- retry_after): acks the slot's piece of held events batch_id, with the
-- given events of it failed: each key moves on past what it handled, up to
-- its first failed event, which becomes its head (_fail_head); a key with
-- nothing left held is unblocked. Returns true (a piece of held events is
-- always finished by its ack). PQ003 unless batch_id is the piece handed out,
-- PQ010 for a failed id not in it; 22023 for bad arguments (_check_nack_args).
create or replace function pgque._ack_held(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_batch_id bigint, p_nack_ids bigint[], p_reasons text[], p_retry_after interval,
    p_retry_afters interval[] default null, p_dead_ids bigint[] default null)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
    v_failed bigint;
    v_failed_id bigint;
begin
    perform pgque._check_nack_args(p_batch_id, p_nack_ids, p_reasons, p_retry_after,
                                   p_retry_afters, p_dead_ids);
    if exists (select from unnest(p_nack_ids) i
                where not exists (
                    select from pgque.blocked_key b
                      join pgque.held_event h
                        on h.he_sub = b.bk_sub and h.he_key = b.bk_key
                       and h.he_seq > b.bk_done_seq and h.he_seq <= b.bk_handed_seq
                     where b.bk_sub = p_sub.sub_id and b.bk_batch = p_batch_id
                       and h.ev_id = i)) then
        raise exception using errcode = 'PQ010',
            message = format('nack: some of events %s are not among those handed out of batch %s',
                             pgque._name_for_message(p_nack_ids::text), p_batch_id);
    end if;
    for v_marker in select * from pgque.blocked_key b
                     where b.bk_sub = p_sub.sub_id and b.bk_batch = p_batch_id
                     order by b.bk_key
                     for update loop
        if p_group.cg_policy = 'skip' then
            -- Released by a change to 'skip': what failed is retried, the rest is done.
            perform pgque._held_to_retry(p_queue, p_sub, h,
                                         pgque._reason_of(p_nack_ids, p_reasons, h.ev_id),
                                         pgque._delay_of(p_nack_ids, p_retry_afters,
                                                         p_retry_after, h.ev_id),
                                         h.ev_id = any(coalesce(p_dead_ids, '{}')))
               from pgque.held_event h
              where h.he_sub = p_sub.sub_id and h.he_key = v_marker.bk_key
                and h.he_seq > v_marker.bk_done_seq and h.he_seq <= v_marker.bk_handed_seq
                and h.ev_id = any(p_nack_ids);
            v_marker.bk_done_seq := v_marker.bk_handed_seq;
            v_marker.bk_attempts := 0;
            perform pgque._save_marker(v_marker);
            continue;
        end if;
        select min(h.he_seq) into v_failed from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = v_marker.bk_key
           and h.he_seq > v_marker.bk_done_seq and h.he_seq <= v_marker.bk_handed_seq
           and h.ev_id = any(p_nack_ids);
        if v_failed is null then
            v_marker.bk_done_seq := v_marker.bk_handed_seq;
            v_marker.bk_attempts := 0;
            perform pgque._save_marker(v_marker);
        else
            select h.ev_id into v_failed_id from pgque.held_event h
             where h.he_sub = p_sub.sub_id and h.he_key = v_marker.bk_key
               and h.he_seq = v_failed limit 1;
            perform pgque._fail_head(
                p_queue, p_group, p_sub, v_marker.bk_key, v_failed,
                pgque._reason_of(p_nack_ids, p_reasons, v_failed_id),
                pgque._delay_of(p_nack_ids, p_retry_afters, p_retry_after, v_failed_id),
                v_failed_id = any(coalesce(p_dead_ids, '{}')));
        end if;
    end loop;
    if not found then
        raise exception using errcode = 'PQ003',
            message = format('batch %s is not the open batch of consumer %L', p_batch_id,
                             p_sub.sub_consumer);
    end if;
    return true;
end
$$;

-- pgque._block_keys(queue, group, sub, cur, batch_id, ev_ids, reasons,
-- retry_after, slot): the nack of a slot of a 'pause' group: each key of the
-- failed events (handed out of the open piece of the log) is blocked from its
-- first failed event on, which becomes the head (_fail_head), and the key's
-- failed events are set aside in order: the caller nacks, with the one that
-- failed, each later event of its key in the piece that it did not handle
-- (those it did handle are done); events without a partition key are nacked
-- as under 'skip'. A key blocked already at that
-- event by this batch (a repeated nack) is left as it is. Returns how many
-- went to the dead letters.
create or replace function pgque._block_keys(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_cur pgque.cursor, p_batch_id bigint, p_ev_ids bigint[], p_reasons text[],
    p_retry_after interval, p_slot integer, p_retry_afters interval[] default null,
    p_dead_ids bigint[] default null)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_events pgque.event_template[];
    v_first record;
    v_keyless bigint[];
    v_dead integer := 0;
    v_part smallint;
    v_head_seq bigint;
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    perform pgque._check_nack_args(p_batch_id, p_ev_ids, p_reasons, p_retry_after,
                                   p_retry_afters, p_dead_ids);
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return 0;
    end if;
    -- The piece as handed out: read again, without what a repeated nack set aside.
    v_events := pgque._batch_events(
        p_queue.queue_id, p_sub.sub_id,
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
        coalesce(p_cur.cur_pos, 0), p_cur.cur_handed, null, null, p_slot, p_group.cg_slots);
    if exists (select from unnest(p_ev_ids) i
                where not exists (select from unnest(v_events) e where e.ev_id = i)) then
        raise exception using errcode = 'PQ010',
            message = format('nack: some of events %s are not among those handed out of batch %s',
                             pgque._name_for_message(p_ev_ids::text), p_batch_id);
    end if;
    v_keyless := array(select e.ev_id from unnest(v_events) e
                        where e.ev_id = any(p_ev_ids) and e.ev_extra1 is null);
    if cardinality(v_keyless) > 0 then
        v_dead := pgque._nack(p_queue, p_sub, p_cur, p_batch_id, v_keyless,
                              array(select pgque._reason_of(p_ev_ids, p_reasons, i)
                                      from unnest(v_keyless) i),
                              p_retry_after, p_slot, p_group.cg_slots,
                              array(select pgque._delay_of(p_ev_ids, p_retry_afters,
                                                           p_retry_after, i)
                                      from unnest(v_keyless) i),
                              array(select i from unnest(v_keyless) i
                                     where i = any(coalesce(p_dead_ids, '{}'))));
    end if;
    v_part := pgque._write_part('held');
    for v_first in select e.ev_extra1 as key, min(e.ev_id) as ev_id
                     from unnest(v_events) e
                    where e.ev_id = any(p_ev_ids) and e.ev_extra1 is not null
                    group by e.ev_extra1
                    order by 1 loop
        if exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub.sub_id and b.bk_key = v_first.key) then
            -- Blocked already: by a nack of this piece before (a repeated or a
            -- second nack), or by a dead letter replayed as the key's next event
            -- while the piece was out. What is not set aside yet joins the queue.
            v_dead := v_dead + pgque._merge_held(
                p_queue, p_group, p_sub, v_first.key, p_batch_id,
                array(select e from unnest(v_events) e
                       where e.ev_extra1 = v_first.key and e.ev_id = any(p_ev_ids)
                       order by e.ev_id),
                p_ev_ids, p_reasons, p_retry_after, p_retry_afters, p_dead_ids);
            continue;
        end if;
        insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                      ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
        select p_sub.sub_id, h.ev_extra1, nextval('pgque.held_seq'), p_batch_id, h.ev_id,
               h.ev_time, h.ev_txid, h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_part
          from (select e.* from unnest(v_events) e
                 where e.ev_extra1 = v_first.key and e.ev_id = any(p_ev_ids)
                 order by e.ev_id) h;
        select min(h.he_seq) into v_head_seq from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = v_first.key and h.ev_id = v_first.ev_id
           and h.he_part = v_part;
        insert into pgque.blocked_key (bk_sub, bk_key, bk_from_batch, bk_from_ev, bk_done_seq,
                                       bk_attempts, bk_retry_at, bk_since)
        values (p_sub.sub_id, v_first.key, p_batch_id, v_first.ev_id, v_head_seq - 1,
                0, now(), now());
        v_dead := v_dead + pgque._fail_head(
            p_queue, p_group, p_sub, v_first.key, v_head_seq,
            pgque._reason_of(p_ev_ids, p_reasons, v_first.ev_id),
            pgque._delay_of(p_ev_ids, p_retry_afters, p_retry_after, v_first.ev_id),
            v_first.ev_id = any(coalesce(p_dead_ids, '{}')));
    end loop;
    return v_dead;
end
$$;

-- pgque._merge_held(queue, group, sub, key, batch_id, events, ev_ids, reasons,
-- retry_after, retry_afters, dead_ids): the failed events of blocked key key
-- that a piece of the log (batch batch_id) handed out, not set aside yet, join
-- its queue of held events where they belong: after what the slot read before
-- them, before what it read after (the queue is copied anew, in that order:
-- rows are never updated). When one of them comes before the head, it is the
-- head now, and its failure counts (_fail_head). Returns how many went to the
-- dead letters.
create or replace function pgque._merge_held(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription, p_key text,
    p_batch_id bigint, p_events pgque.event_template[], p_ev_ids bigint[], p_reasons text[],
    p_retry_after interval, p_retry_afters interval[], p_dead_ids bigint[])
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
    v_head pgque.held_event;
    v_new pgque.event_template[];
    v_start bigint;
    v_first pgque.held_event;
begin
    select * into v_marker from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_key
       for update;
    v_new := array(select e from unnest(p_events) e
                    where not exists (select from pgque.held_event x
                                       where x.he_sub = p_sub.sub_id
                                         and x.he_batch = p_batch_id and x.ev_id = e.ev_id)
                    order by e.ev_id);
    if cardinality(v_new) = 0 then
        return 0;  -- set aside already: a nack repeated
    end if;
    v_head := pgque._head_of(v_marker);
    v_start := nextval('pgque.held_seq');
    -- Pending rows keep their order; a new one goes before the first pending row
    -- the slot read after it (of a later batch, or later in this batch).
    with pending as (
        select h.*, row_number() over (order by h.he_seq) as pos
          from pgque.held_event h
         where h.he_sub = p_sub.sub_id and h.he_key = p_key
           and h.he_seq > v_marker.bk_done_seq
    ), merged as (
        select p.he_batch, p.ev_id, p.ev_time, p.ev_txid, p.ev_retry, p.ev_type, p.ev_data,
               p.ev_delayed_id, p.pos as anchor, 1 as kind
          from pending p
        union all
        select p_batch_id, e.ev_id, e.ev_time, e.ev_txid, e.ev_retry, e.ev_type, e.ev_data,
               e.ev_delayed_id,
               coalesce((select min(p.pos) from pending p
                          where p.he_batch > p_batch_id
                             or (p.he_batch = p_batch_id and p.ev_id > e.ev_id)),
                        (select count(*) + 1 from pending)), 0
          from unnest(v_new) e
    )
    insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                  ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
    select p_sub.sub_id, p_key, nextval('pgque.held_seq'), m.he_batch, m.ev_id, m.ev_time,
           m.ev_txid, m.ev_retry, m.ev_type, m.ev_data, m.ev_delayed_id, pgque._write_part('held')
      from (select * from merged order by anchor, kind, ev_id) m;
    update pgque.blocked_key b set bk_done_seq = v_start
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_key;
    v_marker.bk_done_seq := v_start;
    v_first := pgque._head_of(v_marker);
    if v_first.ev_id is distinct from v_head.ev_id then
        -- A failed event the slot read before the head: the head now.
        update pgque.blocked_key b set bk_attempts = 0
         where b.bk_sub = p_sub.sub_id and b.bk_key = p_key;
        return pgque._fail_head(
            p_queue, p_group, p_sub, p_key, v_first.he_seq,
            pgque._reason_of(p_ev_ids, p_reasons, v_first.ev_id),
            pgque._delay_of(p_ev_ids, p_retry_afters, p_retry_after, v_first.ev_id),
            v_first.ev_id = any(coalesce(p_dead_ids, '{}')));
    end if;
    return 0;
end
$$;

-- pgque._slot_nack_ack(queue, group, sub, cur, batch_id, nack_ids, reasons,
-- retry_after, slot): the ack of a slot's piece, with its failed events: of
-- the piece of held events when batch_id is that (_ack_held), else of the
-- piece of the log, whose failures the group's policy decides (_block_keys
-- or _nack) before its ack. Returns what the ack returns.
create or replace function pgque._slot_nack_ack(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription,
    p_cur pgque.cursor, p_batch_id bigint, p_nack_ids bigint[], p_reasons text[],
    p_retry_after interval, p_slot integer, p_retry_afters interval[] default null,
    p_dead_ids bigint[] default null)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    -- Retries under skip count against the group's max_retries when it has one.
    p_queue.queue_max_retries := coalesce(p_group.cg_max_retries, p_queue.queue_max_retries);
    if p_batch_id is distinct from p_cur.cur_batch
       and exists (select from pgque.blocked_key b
                    where b.bk_sub = p_sub.sub_id and b.bk_batch = p_batch_id) then
        return pgque._ack_held(p_queue, p_group, p_sub, p_batch_id, p_nack_ids, p_reasons,
                               p_retry_after, p_retry_afters, p_dead_ids);
    end if;
    if p_group.cg_policy = 'pause' then
        perform pgque._block_keys(p_queue, p_group, p_sub, p_cur, p_batch_id, p_nack_ids,
                                  p_reasons, p_retry_after, p_slot, p_retry_afters, p_dead_ids);
    else
        perform pgque._nack(p_queue, p_sub, p_cur, p_batch_id, p_nack_ids, p_reasons,
                            p_retry_after, p_slot, p_group.cg_slots, p_retry_afters,
                            p_dead_ids);
    end if;
    return pgque._ack(p_sub, p_cur, p_batch_id);
end
$$;

-- pgque._set_policy(queue, group, policy, max_attempts, pause_timeout,
-- max_retries): sets a group's failure policy, the bounds of a pause (null:
-- none) and the retries of a failed event under skip (null: the queue's
-- max_retries). 22023 for a policy other than 'skip' or 'pause',
-- max_attempts below 1, a pause_timeout not above zero or a negative
-- max_retries; nothing changes then. Going to 'skip'
-- releases every blocked key of the group: their held events are handed out
-- next, in order, and a failure among them goes to the retry queue.
create or replace function pgque._set_policy(
    p_queue pgque.queue, p_group pgque.consumer_group, p_policy text, p_max_attempts integer,
    p_pause_timeout interval, p_max_retries integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_policy is null or p_policy not in ('skip', 'pause') then
        raise exception using errcode = '22023',
            message = format('failure policy must be ''skip'' or ''pause'', not %L',
                             pgque._name_for_message(p_policy));
    end if;
    if p_max_attempts < 1 then
        raise exception using errcode = '22023',
            message = format('max_attempts must be at least 1 (or null: no bound), not %s',
                             p_max_attempts);
    end if;
    if p_max_retries < 0 then
        raise exception using errcode = '22023',
            message = format('max_retries must not be negative (or null: the queue''s), not %s',
                             p_max_retries);
    end if;
    if p_pause_timeout <= interval '0' then
        raise exception using errcode = '22023',
            message = format('pause_timeout must be above zero (or null: no bound), not %s',
                             p_pause_timeout);
    end if;
    update pgque.consumer_group
       set cg_policy = p_policy, cg_max_attempts = p_max_attempts,
           cg_pause_timeout = p_pause_timeout, cg_max_retries = p_max_retries
     where cg_id = p_group.cg_id;
    if p_policy = 'skip' then
        update pgque.blocked_key b set bk_retry_at = now()
          from pgque.subscription s
         where s.sub_queue = p_queue.queue_id and b.bk_sub = s.sub_id
           and s.sub_consumer = any(array(
                   select pgque._slot_name(p_group.cg_consumer, k, p_group.cg_slots)
                     from generate_series(0, p_group.cg_slots - 1) k))
           and b.bk_retry_at > now();
    end if;
end
$$;

-- pgque.set_failure_policy(queue, consumer, policy, max_attempts,
-- pause_timeout, max_retries): what a failed event of consumer group consumer
-- does to its key: 'skip' (the default: it goes to the retry queue, the key
-- moves on, and after max_retries retries, the group's or else the queue's,
-- to the dead letters) or 'pause' (the key waits for it; see the top of this
-- file), with the bounds of a pause: after max_attempts failures of the head,
-- or once it blocked its key for pause_timeout, the head goes to the dead
-- letters (null: no bound).
-- Those who may use the group may set it. PQ002 for a group that is not
-- subscribed, PQ014 for a role that may not use it, 22023 for bad values.
create or replace function pgque.set_failure_policy(
    p_queue text, p_consumer text, p_policy text, p_max_attempts integer default 10,
    p_pause_timeout interval default interval '1 hour', p_max_retries integer default null)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    perform pgque._set_policy(v_queue, pgque._group(v_queue, p_consumer, null), p_policy,
                              p_max_attempts, p_pause_timeout, p_max_retries);
end
$$;

-- pgque.failure_policy(queue, consumer): consumer group consumer's failure
-- policy and the bounds of a pause (null: none). PQ002 for a group that is
-- not subscribed, PQ014 for a role that may not use it.
create or replace function pgque.failure_policy(
    p_queue text, p_consumer text,
    out policy text, out max_attempts integer, out pause_timeout interval,
    out max_retries integer)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_group pgque.consumer_group := pgque._group(pgque._queue_row(p_queue), p_consumer, null);
begin
    policy := v_group.cg_policy;
    max_attempts := v_group.cg_max_attempts;
    pause_timeout := v_group.cg_pause_timeout;
    max_retries := v_group.cg_max_retries;
end
$$;

-- pgque.blocked_keys(queue, consumer): the blocked keys of consumer group
-- consumer, by slot and key: each with its head (the event that failed),
-- how often it failed, its first and last error, since when it blocks the
-- key, when it is due again, and how many events are held behind it. PQ002
-- for a group that is not subscribed, PQ014 for a role that may not use it.
create or replace function pgque.blocked_keys(p_queue text, p_consumer text)
returns table (slot integer, key text, ev_id bigint, ev_time timestamptz, ev_type text,
               ev_data text, attempts integer, first_error text, last_error text,
               blocked_since timestamptz, last_failure timestamptz, retry_at timestamptz,
               held_behind bigint)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
begin
    return query
        select k, b.bk_key, h.ev_id, h.ev_time, h.ev_type, h.ev_data, b.bk_attempts,
               b.bk_first_error, b.bk_last_error, b.bk_since, b.bk_last_failure,
               b.bk_retry_at,
               (select count(*) from pgque.held_event x
                 where x.he_sub = b.bk_sub and x.he_key = b.bk_key
                   and x.he_seq > h.he_seq)
          from generate_series(0, v_group.cg_slots - 1) k
          join pgque.subscription s
            on s.sub_queue = v_queue.queue_id
           and s.sub_consumer = pgque._slot_name(v_group.cg_consumer, k, v_group.cg_slots)
          join pgque.blocked_key b on b.bk_sub = s.sub_id
         cross join lateral (select x.* from pgque.held_event x
                              where x.he_sub = b.bk_sub and x.he_key = b.bk_key
                                and x.he_seq > b.bk_done_seq
                              order by x.he_seq limit 1) h
         order by k, b.bk_key;
end
$$;

-- pgque._blocked_marker(queue, consumer, key, action): for the ledger's verbs:
-- the group, the slot subscription of key (by the routing) under its receive
-- lock, and the key's marker, locked; the caller may use the group (PQ014)
-- and the key is blocked (PQ027), its head not handed out to the slot's owner
-- now (PQ028: a worker handles it; act after its ack). A piece handed out to
-- a session that no longer owns the slot is void: the next owner gets a new
-- one. action names the verb for messages.
create or replace function pgque._blocked_marker(
    p_queue text, p_consumer text, p_key text, p_action text,
    out queue pgque.queue, out grp pgque.consumer_group, out sub pgque.subscription,
    out marker pgque.blocked_key)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    queue := pgque._queue_row(p_queue);
    grp := pgque._group(queue, p_consumer, null);
    select * into v from pgque._find_subscription(
        queue, pgque._slot_name(p_consumer, pgque.slot_of(p_key, grp.cg_slots), grp.cg_slots),
        true);
    sub := v.sub;
    select * into marker from pgque.blocked_key b
     where b.bk_sub = sub.sub_id and b.bk_key = p_key
       for update;
    if not found then
        raise exception using errcode = 'PQ027',
            message = format('cannot %s: key %L is not blocked in consumer group %L of queue %L',
                             p_action, pgque._name_for_message(p_key),
                             pgque._name_for_message(p_consumer), queue.queue_name);
    end if;
    if marker.bk_batch is not null then
        if pgque._slot_owned(queue, grp, sub) then
            raise exception using errcode = 'PQ028',
                message = format('cannot %s: the head of key %L is handed out now (batch %s); '
                                 'try again once it is acked', p_action,
                                 pgque._name_for_message(p_key), marker.bk_batch);
        end if;
        -- Its owner is gone: the piece is void, the next owner gets a new one.
        update pgque.blocked_key b set bk_batch = null, bk_handed_seq = null, bk_epoch = null
         where b.bk_sub = sub.sub_id and b.bk_batch = marker.bk_batch;
        marker.bk_batch := null;
        marker.bk_handed_seq := null;
        marker.bk_epoch := null;
    end if;
end
$$;

-- pgque._head_of(marker): the marker's head, its first held event not handled.
create or replace function pgque._head_of(p_marker pgque.blocked_key)
returns pgque.held_event
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select h.* from pgque.held_event h
     where h.he_sub = p_marker.bk_sub and h.he_key = p_marker.bk_key
       and h.he_seq > p_marker.bk_done_seq
     order by h.he_seq limit 1
$$;

-- pgque.retry_head(queue, consumer, key): the blocked key's head is due now:
-- the slot's next receive hands it out (its attempts go on counting). PQ027
-- unless the key is blocked in the group, PQ028 while its head is handed
-- out, PQ014 for a role that may not use the group.
create or replace function pgque.retry_head(p_queue text, p_consumer text, p_key text)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._blocked_marker(p_queue, p_consumer, p_key, 'retry the head');
    update pgque.blocked_key b set bk_retry_at = now()
     where b.bk_sub = (v.marker).bk_sub and b.bk_key = p_key;
end
$$;

-- pgque.skip_head(queue, consumer, key, reason): the blocked key's head goes
-- to the dead letters (with reason, else its last error) and the key moves
-- on: its held events are handed out next. Returns the head's ev_id. Errors
-- as retry_head.
create or replace function pgque.skip_head(p_queue text, p_consumer text, p_key text,
                                           p_reason text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._blocked_marker(p_queue, p_consumer, p_key, 'skip the head');
    return pgque._kill_head(v.queue, v.sub, v.marker,
                            coalesce(p_reason, (v.marker).bk_last_error));
end
$$;

-- pgque.resume_key(queue, consumer, key): the blocked key moves on without
-- waiting for its head: the head goes to the slot's retry queue, as under
-- 'skip' (so it comes back after the key's later events), and the held
-- events are handed out next. Returns the head's ev_id. Errors as retry_head.
create or replace function pgque.resume_key(p_queue text, p_consumer text, p_key text)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_head pgque.held_event;
begin
    select * into v from pgque._blocked_marker(p_queue, p_consumer, p_key, 'resume the key');
    v_head := pgque._head_of(v.marker);
    insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time, ev_retry,
                                   ev_type, ev_data, ev_extra1, ev_delayed_id, rq_part)
    values (now(), (v.queue).queue_id, (v.sub).sub_id, v_head.ev_id, v_head.ev_time,
            v_head.ev_retry + (v.marker).bk_attempts, v_head.ev_type, v_head.ev_data, p_key,
            v_head.ev_delayed_id, pgque._write_part('retry'));
    v.marker.bk_done_seq := v_head.he_seq;
    v.marker.bk_attempts := 0;
    v.marker.bk_retry_at := now();
    perform pgque._save_marker(v.marker);
    return v_head.ev_id;
end
$$;

-- pgque._hold_first(sub, cur, dead): puts dead letter dead back as the next
-- event of its key in the slot subscription sub (locked by the caller, its
-- cursor cur): before every event of the key the slot has not handed out yet.
-- When the key is blocked, it becomes the head, ahead of what is held (whose
-- pending rows are copied behind it: rows are never updated); when not, the
-- key is blocked from the slot's next unread event on, with it as the head,
-- due now. Its retry count starts again at 0. PQ028 while the key's piece of
-- held events is handed out.
create or replace function pgque._hold_first(p_sub pgque.subscription, p_cur pgque.cursor,
                                             p_dead pgque.dead_letter)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_marker pgque.blocked_key;
    v_blocked boolean;
    v_part smallint := pgque._write_part('held');
    v_seq bigint := nextval('pgque.held_seq');
begin
    select * into v_marker from pgque.blocked_key b
     where b.bk_sub = p_sub.sub_id and b.bk_key = p_dead.ev_extra1
       for update;
    v_blocked := found;
    if v_blocked and v_marker.bk_batch is not null then
        raise exception using errcode = 'PQ028',
            message = format('cannot replay dead letter %s as the next event of key %L: the '
                             'key''s head is handed out now (batch %s); try again once it is '
                             'acked', p_dead.dl_id, pgque._name_for_message(p_dead.ev_extra1),
                             v_marker.bk_batch);
    end if;
    insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                  ev_retry, ev_type, ev_data, he_part)
    values (p_sub.sub_id, p_dead.ev_extra1, v_seq, 0, p_dead.ev_id, p_dead.ev_time,
            p_dead.ev_txid, 0, p_dead.ev_type, p_dead.ev_data, v_part);
    if v_blocked then
        -- What was pending follows it, copied with new numbers; the old rows
        -- fall below bk_done_seq, done.
        insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                      ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
        select h.he_sub, h.he_key, nextval('pgque.held_seq'), h.he_batch, h.ev_id, h.ev_time,
               h.ev_txid, h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_part
          from (select x.* from pgque.held_event x
                 where x.he_sub = p_sub.sub_id and x.he_key = p_dead.ev_extra1
                   and x.he_seq > v_marker.bk_done_seq and x.he_seq < v_seq
                 order by x.he_seq) h;
        update pgque.blocked_key b
           set bk_done_seq = v_seq - 1, bk_attempts = 0, bk_retry_at = now(), bk_since = now(),
               bk_first_error = null, bk_last_error = null, bk_last_failure = null
         where b.bk_sub = p_sub.sub_id and b.bk_key = p_dead.ev_extra1;
        return;
    end if;
    -- Not blocked: held from the slot's next unread event of its log on (in its
    -- open batch after what was handed out, else from the next batch).
    insert into pgque.blocked_key (bk_sub, bk_key, bk_from_batch, bk_from_ev, bk_done_seq,
                                   bk_attempts, bk_retry_at, bk_since)
    values (p_sub.sub_id, p_dead.ev_extra1,
            coalesce(p_cur.cur_batch, pg_sequence_last_value('pgque.batch_id_seq'), 0),
            case when p_cur.cur_batch is not null then coalesce(p_cur.cur_handed, 0) + 1
                 else 9223372036854775807 end,
            v_seq - 1, 0, now(), now());
end
$$;
