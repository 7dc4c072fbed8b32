-- pgque: batches (receive, ack, nack).
--
-- A batch of a subscription is the set of events committed as of its next
-- tick's snapshot and not as of its last finished tick's snapshot. It is
-- fixed once opened, may be handed out in pieces (max_events), and is
-- finished by ack() only when every event in it was handed out.

-- pgque.batch_event: one received event, the one row type of every receive
-- (receive, receive_partitioned, ack_receive_partitioned, receive_slots):
-- the batch it belongs to, then the event. ev_extra1 is its partition key
-- (the name is PgQ's). epoch is the slot owner's fencing epoch for a slot's
-- batch (see slots/fence.sql), slot the slot; both null for a plain
-- consumer's. delayed_id is the id its delayed send returned, for an event
-- that waited as a delayed event (log/delay.sql). A batch with nothing left
-- to hand out is one row of nulls but batch_id (and slot, epoch).
create type pgque.batch_event as (
    batch_id  bigint,
    ev_id     bigint,
    ev_time   timestamptz,
    ev_retry  integer,
    ev_type   text,
    ev_data   text,
    ev_extra1 text,
    epoch     bigint,
    slot      integer,
    delayed_id bigint
);

-- pgque._next_tick(queue, cur): the tick that closes the next batch of a
-- cursor with no open batch, or null: the furthest tick whose sequence
-- position is at most ticker_max_count past the cursor's, so a consumer that
-- fell several ticks behind takes them in one batch of bounded size, and at
-- least the very next tick.
create or replace function pgque._next_tick(p_queue pgque.queue, p_cur pgque.cursor)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return coalesce(
        (select t.tick_id from pgque.tick t
          where t.tick_queue = p_queue.queue_id and t.tick_id > p_cur.cur_last_tick
            and t.tick_event_seq <= (select l.tick_event_seq from pgque.tick l
                                      where l.tick_queue = p_queue.queue_id
                                        and l.tick_id = p_cur.cur_last_tick)
                                    + p_queue.queue_ticker_max_count
          order by t.tick_id desc limit 1),
        (select t.tick_id from pgque.tick t
          where t.tick_queue = p_queue.queue_id and t.tick_id > p_cur.cur_last_tick
          order by t.tick_id limit 1));
end
$$;

-- pgque._check_max_events(max_events): 22023 unless null or at least 1.
create or replace function pgque._check_max_events(p_max_events integer)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_max_events is not null and p_max_events < 1 then
        raise exception using errcode = '22023', message = 'max_events must be at least 1';
    end if;
end
$$;

-- pgque._events_asked(max_events): how many events receive reads for a piece
-- of max_events (null: no limit): one more, to tell whether the batch goes
-- on; computed in bigint and capped, so that max_events = 2^31 - 1 does not
-- overflow (no batch holds that many events: no array could).
create or replace function pgque._events_asked(p_max_events integer)
returns integer
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_max_events is null then
        return null;
    end if;
    return least(p_max_events::bigint + 1, 2147483647)::integer;
end
$$;

-- pgque._has_next_tick(queue_id, cur): whether a cursor has a batch to open
-- or an open one: the check receive makes before taking any lock, so an idle
-- consumer's poll writes nothing and uses no transaction id.
create or replace function pgque._has_next_tick(p_queue_id integer, p_cur pgque.cursor)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return p_cur.cur_batch is not null
        or exists (select 1 from pgque.tick t
                    where t.tick_queue = p_queue_id and t.tick_id > p_cur.cur_last_tick);
end
$$;

-- pgque._receive(queue, sub, cur, max_events, slot, slots, ahead, ahead_next):
-- opens the next batch of the locked subscription sub (cursor cur), or
-- continues its open one, and returns up to max_events of its events not yet
-- acked, as rows (batch_id, event...). Batches with no events for this
-- subscription (or slot) are consumed on the spot, several in one call, so
-- consumers never see them. An open batch with nothing left yields one row
-- whose ev_id is null; no rows means there is no batch (no tick after the
-- last one). ahead, when given, are the first events (at most
-- _events_asked(max_events)) of the batch from cur's last tick to tick
-- ahead_next, read by the caller for this very cursor: that batch is opened
-- without reading it again.
create or replace function pgque._receive(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor, p_max_events integer,
    p_slot integer default null, p_slots integer default null,
    p_ahead pgque.event_template[] default null, p_ahead_next bigint default null)
returns setof pgque.batch_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_events pgque.event_template[];
    v_count integer;
    v_moved boolean := false;
    v_steps integer := 0;
    v_ask integer := pgque._events_asked(p_max_events);
    v_again boolean := false;
begin
    -- max_events was checked by the caller (receive, receive_partitioned).
    if p_cur.cur_batch is null then
        loop
            if v_steps = 0 and p_ahead is not null then
                -- Read by the caller for this cursor (receive_partitioned's
                -- _slot_read_ahead): the batch up to p_ahead_next.
                p_cur.cur_next_tick := p_ahead_next;
                v_events := p_ahead;
            else
                p_cur.cur_next_tick := pgque._next_tick(p_queue, p_cur);
                exit when p_cur.cur_next_tick is null;
                v_events := pgque._batch_events(
                    p_queue.queue_id, p_sub.sub_id,
                    pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
                    pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
                    0, null, v_ask, null, p_slot, p_slots);
            end if;
            exit when coalesce(cardinality(v_events), 0) > 0;
            -- Nothing here for us: consume the batch now instead of a round
            -- trip to hand out and ack nothing (bounded, to keep calls short).
            p_cur.cur_last_tick := p_cur.cur_next_tick;
            v_moved := true;
            v_steps := v_steps + 1;
            exit when v_steps >= 100;
        end loop;
        if coalesce(cardinality(v_events), 0) = 0 then
            if v_moved then
                p_cur.cur_next_tick := null;
                perform pgque._save_cursor(p_cur);
            end if;
            return;
        end if;
        p_cur.cur_batch := nextval('pgque.batch_id_seq');
        p_cur.cur_pos := 0;
        p_cur.cur_end := null;
    else
        -- A slot with blocked keys hands a piece out again as it was, whatever
        -- max_events now: the events it set aside stay ahead of the cursor
        -- until its ack (slots/pause.sql).
        v_again := p_slot is not null and coalesce(p_cur.cur_handed, 0) > coalesce(p_cur.cur_pos, 0)
                   and pgque._has_blocked(p_sub.sub_id);
        v_events := pgque._batch_events(
            p_queue.queue_id, p_sub.sub_id,
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
            p_cur.cur_pos, case when v_again then p_cur.cur_handed end,
            case when not v_again then v_ask end, null, p_slot, p_slots);
    end if;

    v_count := coalesce(cardinality(v_events), 0);
    if v_again then
        null;  -- the same piece: the cursor says so already
    elsif p_max_events is not null and v_count > p_max_events then
        v_events := v_events[1:p_max_events];
        v_count := p_max_events;
    else
        p_cur.cur_end := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
    end if;
    if not v_again then
        p_cur.cur_handed := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
        perform pgque._save_cursor(p_cur);
    end if;
    -- A slot with blocked keys (the pause policy, slots/pause.sql) sets their
    -- events aside instead of handing them out; the cursor passes them all the same.
    if p_slot is not null and pgque._has_blocked(p_sub.sub_id) then
        v_events := pgque._hold_events(p_sub.sub_id, p_cur.cur_batch, v_events);
        v_count := coalesce(cardinality(v_events), 0);
    end if;

    if v_count = 0 then
        return query select p_cur.cur_batch, null::bigint, null::timestamptz, null::integer,
                            null::text, null::text, null::text, null::bigint, p_slot,
                            null::bigint;
    else
        return query select p_cur.cur_batch, e.ev_id, e.ev_time, e.ev_retry, e.ev_type, e.ev_data,
                            e.ev_extra1, null::bigint, p_slot, e.ev_delayed_id
                       from unnest(v_events) e;
    end if;
end
$$;

-- pgque._ack_cursors(curs): acks what the latest receive handed out of the
-- open batch of each of curs (cursors of subscriptions the caller holds
-- locked, their batches checked): a piece that reached the end of its batch
-- finishes it and the cursor moves to its tick, else the position inside the
-- batch advances. One cursor write for them all; returns, in the order of
-- curs, whether each finished its batch. The one definition of what an ack
-- writes, for ack (one cursor) and ack_slots (slots/sets.sql).
create or replace function pgque._ack_cursors(p_curs pgque.cursor[])
returns boolean[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_done boolean[];
    v_saved integer;
begin
    with acked as (
        select i, p_curs[i] as cur,
               (p_curs[i]).cur_end is not null
               and (p_curs[i]).cur_handed >= (p_curs[i]).cur_end as finished
          from generate_subscripts(p_curs, 1) i
    ), saved as (
        insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                                  cur_pos, cur_handed, cur_end, cur_part)
        select (a.cur).cur_sub, (a.cur).cur_seq + 1,
               case when a.finished then (a.cur).cur_next_tick else (a.cur).cur_last_tick end,
               case when not a.finished then (a.cur).cur_batch end,
               case when not a.finished then (a.cur).cur_next_tick end,
               case when not a.finished then (a.cur).cur_handed end,
               case when not a.finished then (a.cur).cur_handed end,
               case when not a.finished then (a.cur).cur_end end,
               (select pgque._write_part('cursor'))
          from acked a
        on conflict do nothing
        returning 1
    )
    select array_agg(a.finished order by a.i), (select count(*) from saved)
      into v_done, v_saved
      from acked a;
    if v_saved < coalesce(cardinality(p_curs), 0) then
        perform pgque._cursor_moved();
    end if;
    return v_done;
end
$$;

-- pgque._ack(sub, cur, batch_id): acks what the latest receive handed out of
-- the open batch of the locked subscription sub (_ack_cursors); true when
-- that finished the batch. Raises PQ003 if batch_id is not the open batch.
create or replace function pgque._ack(p_sub pgque.subscription, p_cur pgque.cursor,
                                      p_batch_id bigint)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    return (pgque._ack_cursors(array[p_cur]))[1];
end
$$;

-- pgque._require_batch(sub, cur, batch_id): PQ003 unless batch_id is the open batch.
create or replace function pgque._require_batch(p_sub pgque.subscription, p_cur pgque.cursor,
                                                p_batch_id bigint)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_batch_id is null or p_cur.cur_batch is distinct from p_batch_id then
        raise exception using errcode = 'PQ003',
            message = format('batch %s is not the open batch of consumer %L', p_batch_id,
                             p_sub.sub_consumer);
    end if;
end
$$;

-- pgque._nack(queue, sub, cur, batch_id, ev_ids, reasons, retry_after, slot,
-- slots): sends events that the latest receive handed out of the open batch
-- to the retry queue, due after retry_after, or to dead letters once they were
-- retried max_retries times. reasons is null, one reason for all, or one per
-- id. Returns how many went to dead letters. The batch stays open: ack it as
-- usual. Idempotent per event and batch: an event nacked before in the same
-- open batch (a consumer that died between its nack and its ack, and nacks
-- again) is left as it is, so one failure is one retry or one dead letter
-- (its nack record, pgque.batch_nack, in the partition of the batch,
-- _nack_part, whose key a repeated nack hits, under REPEATABLE READ with a
-- snapshot older than the first nack too: 40001). The retries go to the
-- partition written now (rotation.sql).
-- Raises PQ003 if batch_id is not the open batch, PQ010 if an id is null or
-- not among the events handed out.
create or replace function pgque._nack(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor, p_batch_id bigint,
    p_ev_ids bigint[], p_reasons text[], p_retry_after interval,
    p_slot integer default null, p_slots integer default null,
    p_retry_afters interval[] default null, p_dead_ids bigint[] default null)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_events pgque.event_template[];
    v_wanted integer;
    v_dead integer;
    v_nack_part smallint;
    v_retry_part smallint;
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    perform pgque._check_nack_args(p_batch_id, p_ev_ids, p_reasons, p_retry_after,
                                   p_retry_afters, p_dead_ids);
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return 0;
    end if;
    -- Looked up only now: an ack of a slot passes here with no ids each time.
    v_nack_part := pgque._nack_part(p_batch_id);
    v_retry_part := pgque._write_part('retry');
    v_events := pgque._batch_events(
        p_queue.queue_id, p_sub.sub_id,
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
        coalesce(p_cur.cur_pos, 0), p_cur.cur_handed, null, p_ev_ids,
        p_slot, p_slots);
    select count(distinct i) into v_wanted from unnest(p_ev_ids) i;
    if (select count(distinct e.ev_id) from unnest(v_events) e) <> v_wanted then
        raise exception using errcode = 'PQ010',
            message = format('nack: some of events %s are not among those handed out of batch %s',
                             pgque._name_for_message(p_ev_ids::text), p_batch_id);
    end if;

    -- One row per event id: its newest copy (a batch holds two copies of an
    -- id only if a retry was re-inserted beside the original), with its
    -- reason, and only if this batch has not nacked it already.
    with asked as (
        select i.id, case when cardinality(p_reasons) = 1 then p_reasons[1]
                          else p_reasons[i.n] end as reason,
               coalesce(p_retry_afters[i.n], p_retry_after) as delay,
               i.id = any(coalesce(p_dead_ids, '{}')) as dead
          from unnest(p_ev_ids) with ordinality i(id, n)),
    fresh as (
        insert into pgque.batch_nack (bn_sub, bn_batch, bn_ev_id, bn_part)
        select distinct p_sub.sub_id, p_batch_id, a.id, v_nack_part from asked a
        on conflict do nothing
        returning bn_ev_id),
    nacked as (
        select distinct on (e.ev_id) e.*, a.reason, a.delay, a.dead
          from unnest(v_events) e
          cross join lateral (select a.reason, a.delay, a.dead from asked a
                               where a.id = e.ev_id limit 1) a
          join fresh f on f.bn_ev_id = e.ev_id
         order by e.ev_id, e.ev_retry desc),
    dead as (
        insert into pgque.dead_letter (dl_queue, dl_consumer, dl_sub, dl_reason, ev_id, ev_time,
                                       ev_txid, ev_retry, ev_type, ev_data, ev_extra1)
        select p_queue.queue_id, p_sub.sub_consumer, p_sub.sub_id, e.reason, e.ev_id, e.ev_time,
               e.ev_txid, e.ev_retry, e.ev_type, e.ev_data, e.ev_extra1
          from nacked e
         where e.ev_retry >= p_queue.queue_max_retries or e.dead
        returning 1),
    retried as (
        insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                       ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id,
                                       rq_part)
        select now() + e.delay, p_queue.queue_id, p_sub.sub_id, e.ev_id, e.ev_time,
               e.ev_retry + 1, e.ev_type, e.ev_data, e.ev_extra1, e.ev_delayed_id, v_retry_part
          from nacked e
         where e.ev_retry < p_queue.queue_max_retries and not e.dead
        returning 1)
    select (select count(*) from dead) into v_dead;
    return v_dead;
end
$$;

-- pgque._plain_sub(queue, consumer, lock): the queue and subscription rows
-- and cursor of a plain consumer (as _find_subscription gives them, with the
-- receive lock when lock), refusing slot subscriptions (PQ021: they go
-- through the partition layer, which checks ownership) and callers that may
-- not use the consumer (PQ014, PQ015).
create or replace function pgque._plain_sub(
    p_queue text, p_consumer text, p_lock boolean,
    out queue pgque.queue, out sub pgque.subscription, out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    queue := pgque._queue_row(p_queue);
    select * into v from pgque._find_subscription(queue, p_consumer, p_lock);
    if position('#' in (v.sub).sub_consumer) > 0 then
        raise exception using errcode = 'PQ021',
            message = format('%L is a slot subscription; use receive_partitioned and its ack',
                             (v.sub).sub_consumer);
    end if;
    perform pgque._require_consumer(queue, (v.sub).sub_owner, (v.sub).sub_grantees,
                                    p_consumer);
    sub := v.sub;
    cur := v.cur;
end
$$;

-- pgque._handed_whole(): the position (cur_handed, cur_end) of a batch that
-- receive handed out whole, its rows straight from the reader (see receive):
-- past any event id, so the ack that follows finishes the batch.
create or replace function pgque._handed_whole()
returns bigint
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return 9223372036854775807;  -- PL/pgSQL: on the hot path (design-notes.md)
end
$$;

-- pgque.receive(queue, consumer, max_events): the consumer's open batch, or
-- its next one, as pgque.batch_event rows (epoch null), at most max_events
-- of them (null: the whole batch).
-- Blocks while another session holds the same subscription's receive lock,
-- then returns the same open batch. An open batch with no events left yields
-- one row with a null ev_id; no rows means no batch is ready.
-- The whole batch (max_events null) is returned as the queue's batch reader
-- reads it, row by row, and the cursor then records it as handed out whole
-- (_handed_whole): collecting the rows into an array first, as pieces and
-- slots need (_receive), cost twice the read. Its batch id is taken before
-- the read, so a call that finds only batches with no events for this
-- consumer (consumed on the spot, as _receive does) leaves a gap in the ids.
create or replace function pgque.receive(p_queue text, p_consumer text, p_max_events integer default null)
returns setof pgque.batch_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_cur pgque.cursor;
    v_rows text;
    v_opening boolean;
    v_count integer := 0;
    v_steps integer := 0;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._plain_sub(p_queue, p_consumer, false);
    if not pgque._has_next_tick((v.queue).queue_id, v.cur) then
        return;  -- idle: no lock taken, nothing written
    end if;
    select v.queue, f.sub, f.cur into v
      from pgque._find_subscription(v.queue, p_consumer, true) f;
    v_rows := 'pgque.' || pgque._batch_reader_name((v.queue).queue_id);
    if p_max_events is not null or to_regproc(v_rows) is null then
        return query select * from pgque._receive(v.queue, v.sub, v.cur, p_max_events);
        return;
    end if;
    -- The reader's plain branch (every reader has one), its rows as they come;
    -- reader names are pgque's own text.
    v_rows := format('select $2, r.ev_id, r.ev_time, r.ev_retry, r.ev_type, r.ev_data,'
                     ' r.ev_extra1, null::bigint, null::integer, r.ev_delayed_id'
                     ' from %s($1) r', v_rows);
    -- An open batch is read again from its position; else the next batch,
    -- past those with nothing for this consumer, consumed on the spot as
    -- _receive does (bounded, to keep calls short).
    v_cur := v.cur;
    v_opening := v_cur.cur_batch is null;
    if v_opening then
        v_cur.cur_batch := nextval('pgque.batch_id_seq');
        v_cur.cur_pos := 0;
    end if;
    loop
        if v_opening then
            v_cur.cur_next_tick := pgque._next_tick(v.queue, v_cur);
            exit when v_cur.cur_next_tick is null;
        end if;
        return query execute v_rows
            using pgque._batch_request(
                      (v.sub).sub_id,
                      pgque._tick_snapshot((v.queue).queue_id, v_cur.cur_last_tick),
                      pgque._tick_snapshot((v.queue).queue_id, v_cur.cur_next_tick),
                      v_cur.cur_pos, null, null, null),
                  v_cur.cur_batch;
        get diagnostics v_count = row_count;
        exit when v_count > 0 or not v_opening;
        v_cur.cur_last_tick := v_cur.cur_next_tick;
        v_steps := v_steps + 1;
        exit when v_steps >= 100;
    end loop;
    if v_count = 0 and v_opening then
        if v_steps > 0 then  -- the batches passed, with no batch open
            v_cur.cur_batch := null;
            v_cur.cur_next_tick := null;
            v_cur.cur_pos := (v.cur).cur_pos;
            perform pgque._save_cursor(v_cur);
        end if;
        return;
    end if;
    if v_count = 0 then  -- an open batch with nothing left
        return query select v_cur.cur_batch, null::bigint, null::timestamptz, null::integer,
                            null::text, null::text, null::text, null::bigint, null::integer,
                            null::bigint;
    end if;
    v_cur.cur_handed := pgque._handed_whole();
    v_cur.cur_end := v_cur.cur_handed;
    perform pgque._save_cursor(v_cur);
end
$$;

-- pgque.ack(queue, consumer, batch_id): acks what the latest receive handed
-- out; true when that finished the batch, false when more of it remains.
create or replace function pgque.ack(p_queue text, p_consumer text, p_batch_id bigint)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;

-- pgque.nack(queue, consumer, batch_id, ev_ids, retry_after, reason): sends
-- handed-out events of the open batch to retry (or dead letters); returns
-- how many went to dead letters. Ack the batch afterwards as usual.
create or replace function pgque.nack(
    p_queue text, p_consumer text, p_batch_id bigint, p_ev_ids bigint[],
    p_retry_after interval default '0', p_reason text default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    return pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_ev_ids, array[p_reason],
                       p_retry_after);
end
$$;

-- pgque.ack(queue, consumer, batch_id, nack_ids, nack_reasons, retry_after):
-- nacks the given handed-out events (as nack() does, with one reason for all
-- or one per id) and acks the batch piece, in one transaction: a consumer
-- cannot end up having nacked without acking. Returns what ack() returns.
create or replace function pgque.ack(
    p_queue text, p_consumer text, p_batch_id bigint, p_nack_ids bigint[],
    p_nack_reasons text[], p_retry_after interval)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    perform pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_nack_ids, p_nack_reasons,
                        p_retry_after);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;

-- pgque.ack(queue, consumer, batch_id, nack_ids, nack_reasons, retry_after,
-- retry_afters, dead_ids): the same, with a delay per failed event
-- (retry_afters, one per nack id; a null one: retry_after) and the failed
-- events not to retry (dead_ids, among nack_ids: to the dead letters now).
create or replace function pgque.ack(
    p_queue text, p_consumer text, p_batch_id bigint, p_nack_ids bigint[],
    p_nack_reasons text[], p_retry_after interval, p_retry_afters interval[],
    p_dead_ids bigint[])
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._plain_sub(p_queue, p_consumer, true);
    perform pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_nack_ids, p_nack_reasons,
                        p_retry_after, null, null, p_retry_afters, p_dead_ids);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;
