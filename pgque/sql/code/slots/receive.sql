-- pgque: receiving, acking and nacking one slot of a group.

-- pgque._slot_read_ahead(queue, sub, cur, slot, slots, max_events): for a
-- slot's cursor cur with no open batch, read before any lock: the tick that
-- would close its next batch (next_tick), and that batch's first events as
-- _receive would read them (events); idle is true when there are none, the
-- next tick is the queue's newest, and the last tick is less than
-- _slot_cursor_lag() old (by the database clock). receive_partitioned then
-- returns without locking or writing anything, instead of consuming the
-- empty batch: with N slots, most slots find nothing in most ticks at low
-- rates, and a cursor write with its commit per slot per tick was most of
-- what a group cost. Otherwise _receive uses the events read here if the
-- cursor is still at the same tick once locked: the events between two
-- existing ticks never change, so they need no lock, and a slot with work
-- reads its batch once. Read-only. With an open batch: all null.
create or replace function pgque._slot_read_ahead(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor,
    p_slot integer, p_slots integer, p_max_events integer,
    out idle boolean, out next_tick bigint, out events pgque.event_template[])
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_last pgque.tick;
begin
    idle := false;
    if p_cur.cur_batch is not null then
        return;
    end if;
    next_tick := pgque._next_tick(p_queue, p_cur);
    select * into v_last from pgque.tick
     where tick_queue = p_queue.queue_id and tick_id = p_cur.cur_last_tick;
    if next_tick is null or v_last.tick_id is null then
        return;
    end if;
    events := pgque._batch_events(p_queue.queue_id, p_sub.sub_id, v_last.tick_snapshot,
                                  pgque._tick_snapshot(p_queue.queue_id, next_tick),
                                  0, null, pgque._events_asked(p_max_events), null,
                                  p_slot, p_slots);
    idle := cardinality(events) = 0
            and next_tick = (pgque._last_tick(p_queue.queue_id)).tick_id
            and now() - v_last.tick_time < pgque._slot_cursor_lag();
end
$$;

-- pgque._slot_cursor_lag(): how old a slot's last tick may get while no event
-- of the slot came in, before receive_partitioned moves its cursor to the
-- newest tick (writing it). Bounds the ticks and event tables kept for idle
-- slots, and the lag that monitoring shows for them, also on a queue that
-- stopped ticking.
create or replace function pgque._slot_cursor_lag()
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select interval '1 second' $$;

-- pgque._receive_slot(queue, grp, slot, sub, cur, max_events): the receive of
-- slot slot of group grp, whose subscription sub and cursor cur were read
-- without a lock: returns nothing when the session does not own the slot
-- (PQ024 instead), when there is nothing to receive (taking no lock and
-- writing nothing: an idle poll), or while the previous owner's fenced
-- transaction is open; else opens or continues the slot's batch under the
-- receive lock and returns its piece with the owner's epoch (slots/fence.sql).
-- The caller checked max_events and the group's access.
create or replace function pgque._receive_slot(
    p_queue pgque.queue, p_group pgque.consumer_group, p_slot integer,
    p_sub pgque.subscription, p_cur pgque.cursor, p_max_events integer)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
    v_epoch bigint;
    v_idle boolean;
    v_ahead_next bigint;
    v_ahead pgque.event_template[];
    v_held boolean;
begin
    -- Ownership before the row lock, so a non-owner never waits; then
    -- whether there is anything to receive, so an idle poll writes nothing:
    -- a piece of held events due (slots/pause.sql), or of the log.
    perform pgque._require_owner(p_sub);
    v_held := pgque._held_due(p_sub.sub_id);
    if not v_held then
        if not pgque._has_next_tick(p_queue.queue_id, p_cur) then
            return;  -- idle: no lock taken, nothing written
        end if;
        select * into v_idle, v_ahead_next, v_ahead
          from pgque._slot_read_ahead(p_queue, p_sub, p_cur, p_slot, p_group.cg_slots,
                                      p_max_events);
        if v_idle then
            return;  -- likewise
        end if;
    end if;
    -- Before the receive lock. Null while a transaction fenced by the previous
    -- owner's epoch is still open: nothing is handed out until it ends.
    v_epoch := pgque._slot_epoch(p_sub);
    if v_epoch is null then
        return;
    end if;
    select f.sub, f.cur into v from pgque._find_subscription(p_queue, p_sub.sub_consumer, true) f;
    perform pgque._require_owner(v.sub);  -- the key may have been renewed meanwhile
    if (v.cur).cur_batch is not null or (v.cur).cur_last_tick <> p_cur.cur_last_tick then
        v_ahead := null;  -- the cursor moved meanwhile: what was read ahead is not its batch
    end if;
    -- Held events first, unless the piece of the log handed out is not acked.
    if v_held and not pgque._log_piece_open(v.cur) then
        return query select * from pgque._receive_held(p_queue, p_group, v.sub, p_max_events,
                                                        v_epoch, p_slot);
        if found then
            return;
        end if;
    end if;
    return query select r.batch_id, r.ev_id, r.ev_time, r.ev_retry, r.ev_type, r.ev_data,
                        r.ev_extra1, v_epoch, r.slot, r.delayed_id
                   from pgque._receive(p_queue, v.sub, v.cur, p_max_events, p_slot,
                                       p_group.cg_slots, v_ahead, v_ahead_next) r;
end
$$;

-- pgque.receive_partitioned(queue, consumer, slot, slots, max_events): like
-- receive(), for slot slot of slots of a consumer group: opens the slot's
-- batch under the receive lock and returns only the events whose key routes
-- to the slot, with the owner's epoch (see slots/fence.sql). Refuses (PQ024)
-- unless this session owns the slot.
create or replace function pgque.receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer,
    p_max_events integer default null)
returns setof pgque.batch_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, false);
    return query select * from pgque._receive_slot(v.queue, v.grp, p_slot, v.sub, v.cur,
                                                    p_max_events);
end
$$;

-- pgque.ack_partitioned(queue, consumer, slot, slots, batch_id): ack() for a
-- slot; refuses (PQ024) unless this session owns the slot.
create or replace function pgque.ack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, null, null,
                                interval '0', p_slot);
end
$$;

-- pgque.ack_partitioned(queue, consumer, slot, slots, batch_id, nack_ids,
-- nack_reasons, retry_after): for a slot, nacks the given handed-out events
-- and acks the batch piece in one transaction (see the plain ack with nacks);
-- refuses (PQ024) unless this session owns the slot.
create or replace function pgque.ack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, p_nack_ids,
                                p_nack_reasons, p_retry_after, p_slot);
end
$$;

-- pgque.ack_partitioned(queue, consumer, slot, slots, batch_id, nack_ids,
-- nack_reasons, retry_after, retry_afters, dead_ids): the same, with a delay
-- per failed event (retry_afters, one per nack id; a null one: retry_after)
-- and the failed events not to retry (dead_ids, among nack_ids: to the dead
-- letters now; under pause the key moves on).
create or replace function pgque.ack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_retry_afters interval[], p_dead_ids bigint[])
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, p_nack_ids,
                                p_nack_reasons, p_retry_after, p_slot, p_retry_afters,
                                p_dead_ids);
end
$$;

-- pgque._ack_receive_slot(queue, consumer, slot, slots, batch_id, nack_ids,
-- nack_reasons, retry_after, retry_afters, dead_ids, max_events): what
-- ack_receive_partitioned does (below): ack_partitioned of the
-- slot's batch piece (with its nacks; none when nack_ids is empty or null),
-- then receive_partitioned of the same slot, in one call and one transaction:
-- a consumer that works a slot piece after piece pays one round trip and one
-- commit per piece instead of two. Returns the next piece as
-- receive_partitioned does; nothing when there is none, or when this session
-- released and claimed the slot again since the piece (receive_partitioned
-- then takes the new epoch). Refuses what either
-- refuses (PQ024 unless this session owns the slot, PQ003 for a batch that is
-- not the open one); an error undoes both, the ack included.
create or replace function pgque._ack_receive_slot(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_retry_afters interval[], p_dead_ids bigint[], p_max_events integer)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
    v_cur pgque.cursor;
    v_epoch bigint;
    v_held boolean;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    perform pgque._slot_nack_ack(v.queue, v.grp, v.sub, v.cur, p_batch_id, p_nack_ids,
                                 p_nack_reasons, p_retry_after, p_slot, p_retry_afters,
                                 p_dead_ids);
    -- The receive, from the cursor the ack wrote, under the receive lock the
    -- ack took. Its epoch is the one this session took for the piece just
    -- acked; when it has none (it released and claimed the slot again since),
    -- nothing is received here: receive_partitioned takes a new epoch, before
    -- the receive lock, as it must.
    v_cur := pgque._current_cursor((v.sub).sub_id);
    v_held := pgque._held_due((v.sub).sub_id) and not pgque._log_piece_open(v_cur);
    if not v_held and not pgque._has_next_tick((v.queue).queue_id, v_cur) then
        return;
    end if;
    v_epoch := pgque._held_epoch(v.sub);
    if v_epoch is null then
        return;
    end if;
    if v_held then
        return query select * from pgque._receive_held(v.queue, v.grp, v.sub, p_max_events,
                                                        v_epoch, p_slot);
        if found then
            return;
        end if;
    end if;
    return query select r.batch_id, r.ev_id, r.ev_time, r.ev_retry, r.ev_type, r.ev_data,
                        r.ev_extra1, v_epoch, r.slot, r.delayed_id
                   from pgque._receive(v.queue, v.sub, v_cur, p_max_events, p_slot,
                                       (v.grp).cg_slots) r;
end
$$;

-- pgque.ack_receive_partitioned(queue, consumer, slot, slots, batch_id,
-- nack_ids, nack_reasons, retry_after, max_events): _ack_receive_slot with
-- one delay for every failed event.
create or replace function pgque.ack_receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_max_events integer default null)
returns setof pgque.batch_event
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select * from pgque._ack_receive_slot(p_queue, p_consumer, p_slot, p_slots, p_batch_id,
                                          p_nack_ids, p_nack_reasons, p_retry_after, null,
                                          null, p_max_events)
$$;

-- pgque.ack_receive_partitioned(queue, consumer, slot, slots, batch_id,
-- nack_ids, nack_reasons, retry_after, retry_afters, dead_ids, max_events):
-- the same, with a delay per failed event (retry_afters, one per nack id; a
-- null one: retry_after) and the failed events not to retry (dead_ids: to the
-- dead letters now, under pause the key moves on).
create or replace function pgque.ack_receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_nack_ids bigint[], p_nack_reasons text[], p_retry_after interval,
    p_retry_afters interval[], p_dead_ids bigint[], p_max_events integer)
returns setof pgque.batch_event
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select * from pgque._ack_receive_slot(p_queue, p_consumer, p_slot, p_slots, p_batch_id,
                                          p_nack_ids, p_nack_reasons, p_retry_after,
                                          p_retry_afters, p_dead_ids, p_max_events)
$$;

-- pgque.nack_partitioned(queue, consumer, slot, slots, batch_id, ev_ids,
-- retry_after, reason): nack() for a slot (skip policy: the events go to the
-- slot's retry queue, the batch goes on); refuses (PQ024) unless this session
-- owns the slot.
create or replace function pgque.nack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_ev_ids bigint[], p_retry_after interval default '0', p_reason text default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_queue pgque.queue;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    if p_batch_id is distinct from (v.cur).cur_batch
       and exists (select from pgque.blocked_key b
                    where b.bk_sub = (v.sub).sub_id and b.bk_batch = p_batch_id) then
        raise exception using errcode = 'PQ029',
            message = format('batch %s is a piece of held events: nack its events with its ack '
                             '(ack_partitioned with nack_ids)', p_batch_id);
    end if;
    -- Retries under skip count against the group's max_retries when it has one.
    v_queue := v.queue;
    v_queue.queue_max_retries := coalesce((v.grp).cg_max_retries, v_queue.queue_max_retries);
    if (v.grp).cg_policy = 'pause' then
        return pgque._block_keys(v_queue, v.grp, v.sub, v.cur, p_batch_id, p_ev_ids,
                                 array[p_reason], p_retry_after, p_slot);
    end if;
    return pgque._nack(v_queue, v.sub, v.cur, p_batch_id, p_ev_ids, array[p_reason],
                       p_retry_after, p_slot, (v.grp).cg_slots);
end
$$;
