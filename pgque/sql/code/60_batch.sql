-- pgque: batches (receive, ack, nack).
--
-- A batch of a subscription is the set of events committed as of its next
-- tick's snapshot and not as of its last finished tick's snapshot. It is
-- fixed once opened, may be handed out in pieces (max_events), and is
-- finished by ack() only when every event in it was handed out.


-- pgque.batch_event: one event of a batch as receive and receive_partitioned
-- return it: the batch it belongs to, then the event. ev_extra1 is its
-- partition key (the name is PgQ's). epoch is the slot owner's fencing epoch
-- for a slot's batch (see 66_fence.sql), null for a plain consumer's.
create type pgque.batch_event as (
    batch_id  bigint,
    ev_id     bigint,
    ev_time   timestamptz,
    ev_retry  integer,
    ev_type   text,
    ev_data   text,
    ev_extra1 text,
    epoch     bigint
);

-- pgque._slot_expr(slots): the routing formula of pgque.slot_of (65_partition.sql)
-- over an event row's key (ev_extra1), as SQL text with the slot count spelled out as a
-- literal (an index expression cannot hold a parameter). slots is an
-- integer, so no caller text reaches the result.
create or replace function pgque._slot_expr(p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('(case when ev_extra1 is null then 0'
                  ' else (hashtextextended(ev_extra1, 0) %% %s + %s) %% %s end)',
                  p_slots, p_slots, p_slots)
$$;

-- pgque._dual_filter(slots, in_progress, prev_xmax, sub, slot): the part of a
-- batch's condition that _batch_where and _probe_where share, over an event
-- table e: one half of the dual filter (see _batch_where), the snapshot $4
-- and $2 (next's xmax), retries owned by subscription sub, and the routing
-- formula of slots equal to slot. prev_xmax, sub and slot are SQL
-- expressions written by those two functions, never caller text.
create or replace function pgque._dual_filter(p_slots integer, p_in_progress boolean,
                                              p_prev_xmax text, p_sub text, p_slot text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_in_progress then 'e.ev_txid = x.txid'
                else format('e.ev_txid >= %s and e.ev_txid < $2', p_prev_xmax) end
           || ' and pg_visible_in_snapshot(e.ev_txid, $4)'
           || format(' and (e.ev_owner is null or e.ev_owner = %s)', p_sub)
           -- A group of one slot has every event in its one slot: no filter.
           || case when p_slots is null or p_slots = 1 then ''
                   else format(' and %s = %s', pgque._slot_expr(p_slots), p_slot) end
$$;

-- pgque._batch_where(slots, in_progress): one half of the condition that
-- picks a batch's events from an event table e, as SQL text over the
-- positional parameters
--   $1 prev's xmax, $2 next's xmax, $3 prev's in-progress list (xid8[]),
--   $4 the snapshot next, $5 the subscription, $6 after (ev_id), $7 upto
--   (ev_id, null: no bound), $8 ids (null: all), $9 the slot.
-- The "dual filter": transactions not visible in prev are those at or above
-- its xmax (the half without in_progress) plus those in progress when it was
-- taken, its xip list, all below its xmax (the half with in_progress, over
-- x.txid, one of that list). So the ev_txid index is read for one range and
-- a short list of ids instead of whole tables. The halves are disjoint and
-- are read as two scans, the second one probe per listed id (a lateral
-- subquery behind "offset 0", so that the planner cannot turn it into a hash
-- join over the whole slot; see _read_statement): as one condition, "range or in list", a generic plan of
-- PostgreSQL 15 used the slot index for the slot alone and read every row of
-- the slot in the table. With slots above 1 the routing formula is spelled
-- out with its count as a literal, so the planner can use the tables' slot
-- index (62_slot_index.sql) and read only the slot's rows. Built from an
-- integer only: no caller text. The batch readers (64_batch_reader.sql) hold
-- it as static SQL; _run_reader runs it dynamically for a count they lack.
create or replace function pgque._batch_where(p_slots integer, p_in_progress boolean)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._dual_filter(p_slots, p_in_progress, '$1', '$5', '$9')
           || ' and e.ev_id > $6'
              ' and ($7::bigint is null or e.ev_id <= $7)'
              ' and ($8::bigint[] is null or e.ev_id = any($8))'
$$;

-- pgque._probe_where(slots, in_progress): the same halves for many slots at
-- once, as the probe uses them: over the columns of a row s (k the slot, sub
-- its subscription, prev the snapshot of its last tick) instead of $1, $5
-- and $9 (x.txid one of prev's xip list), with $2 and $4 as above, and no
-- bounds on ev_id. Built from an integer only.
create or replace function pgque._probe_where(p_slots integer, p_in_progress boolean)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._dual_filter(p_slots, p_in_progress, 'pg_snapshot_xmax(s.prev)', 's.sub', 's.k')
$$;

-- pgque._read_statement(queue_id, slots): the statement that reads a batch of
-- the queue for a slot of slots (null: a plain consumer): the events of both
-- halves of _batch_where, each read by its own scan, in ev_id order, at most
-- $10 (null: all), turned into rows only once limited, so that a piece of 100
-- does not build the rows of the whole batch.
create or replace function pgque._read_statement(p_queue_id integer, p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select array(select row(x.*)::pgque.event_template'
                  ' from (select e.* from pgque.%I e where %s'
                  '       union all'
                  '       select e.* from unnest($3) as x(txid)'
                  '        cross join lateral (select e.* from pgque.%I e where %s offset 0) e'
                  '       order by ev_id limit $10) x)',
                  pgque._event_table(p_queue_id), pgque._batch_where(p_slots, false),
                  pgque._event_table(p_queue_id), pgque._batch_where(p_slots, true))
$$;

-- pgque._span_statement(queue_id, slots, limited): the statement that reads
-- a batch of the queue for several slots of a group of slots at once
-- (receive_slots, 69_slot_sets.sql): both halves of the batch's condition as
-- _read_statement has them, for the slots $12 (the routing formula of slots
-- among them) and with the retries of any of their subscriptions $13, in no
-- particular order (the caller orders what it hands out); with limited, at
-- most $10 events per slot, the first by ev_id, as each slot's own read has
-- it, so that pieces of max_events do not read whole batches into memory.
-- $1 .. $4 as for _batch_where. Built from integers only.
create or replace function pgque._span_statement(p_queue_id integer, p_slots integer,
                                                 p_limited boolean)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select array(select row(x.ev_id, x.ev_time, x.ev_txid, x.ev_owner, x.ev_retry,'
                  '                       x.ev_type, x.ev_data, x.ev_extra1)::pgque.event_template'
                  ' from (select e.*%s'
                  '         from (select e.* from pgque.%I e where %s'
                  '               union all'
                  '               select e.* from unnest($3) as x(txid)'
                  '                cross join lateral (select e.* from pgque.%I e where %s'
                  '                                     offset 0) e) e) x%s)',
                  case when p_limited
                       then format(', row_number() over (partition by %s order by e.ev_id) as n',
                                   pgque._slot_expr(p_slots)) else '' end,
                  pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, false, '$1', 'any($13)', 'any($12)'),
                  pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, true, '$1', 'any($13)', 'any($12)'),
                  case when p_limited then ' where x.n <= $10' else '' end)
$$;

-- pgque._probe_statement(queue_id, slots): the statement that finds which of
-- several slots of slots have an event in their batch up to the snapshot $4
-- (xmax $2): for each row of unnest($12 slots, $13 subscriptions, $14 last
-- tick snapshots), at most one of its events, found by scans (one per half
-- of the condition) that stop at the first.
create or replace function pgque._probe_statement(p_queue_id integer, p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select array(select p.ev from unnest($12, $13, $14) s(k, sub, prev)'
                  ' cross join lateral ((select row(e.*)::pgque.event_template as ev'
                  '                        from pgque.%I e where %s limit 1)'
                  '                     union all'
                  '                     (select row(e.*)::pgque.event_template'
                  '                        from pg_snapshot_xip(s.prev) as x(txid)'
                  '                       cross join lateral (select e.* from pgque.%I e'
                  '                                            where %s offset 0) e'
                  '                       limit 1)'
                  '                     limit 1) p)',
                  pgque._event_table(p_queue_id), pgque._probe_where(p_slots, false),
                  pgque._event_table(p_queue_id), pgque._probe_where(p_slots, true))
$$;

-- pgque._run_reader(queue_id, slots, probe, $1 .. $14): runs the read (or,
-- with probe, the probe; with slots above 1 and no slot, the span read for
-- several slots) statement with those parameters (see _batch_where,
-- _read_statement, _probe_statement, _span_statement): through the queue's
-- batch reader when it has a branch for slots, else as dynamic SQL. Every
-- value reaches the statement as a parameter.
create or replace function pgque._run_reader(
    p_queue_id integer, p_slots integer, p_probe boolean,
    p_prev_xmax xid8, p_next_xmax xid8, p_prev_xip xid8[], p_next pg_snapshot,
    p_sub_id integer, p_after bigint, p_upto bigint, p_ids bigint[], p_slot integer,
    p_limit integer, p_probe_slots integer[], p_probe_subs integer[],
    p_probe_prevs pg_snapshot[])
returns pgque.event_template[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_reader text := 'pgque.' || pgque._batch_reader_name(p_queue_id);
    v_events pgque.event_template[];
begin
    -- A reader missing (dropped by hand; maintenance writes it again) is one
    -- without the branch: the dynamic statement below reads the same.
    if to_regproc(v_reader) is not null then
        execute format('select %s($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13,'
                       ' $14, $15)', v_reader)
           into v_events
          using p_prev_xmax, p_next_xmax, p_prev_xip, p_next, p_sub_id, p_after, p_upto, p_ids,
                p_slot, p_limit, p_slots, p_probe_slots, p_probe_subs, p_probe_prevs, p_probe;
        if v_events is not null then
            return v_events;
        end if;
    end if;
    execute case when p_probe then pgque._probe_statement(p_queue_id, p_slots)
                 when p_slots > 1 and p_slot is null
                      then pgque._span_statement(p_queue_id, p_slots, p_limit is not null)
                 else pgque._read_statement(p_queue_id, p_slots) end
       into v_events
      using p_prev_xmax, p_next_xmax, p_prev_xip, p_next, p_sub_id, p_after, p_upto, p_ids,
            p_slot, p_limit, p_slots, p_probe_slots, p_probe_subs, p_probe_prevs;
    return v_events;
end
$$;

-- pgque._batch_events(queue_id, sub_id, prev, next, after, upto, max, ids,
--                     slot, slots):
-- the events of a batch, in ev_id order: those of transactions visible in
-- snapshot next but not in snapshot prev, that are not retries meant for
-- another subscription, with after < ev_id <= upto (upto null: no bound),
-- at most max of them (null: all), only ids when given, and only the hash
-- class slot of slots when slots is given (the condition: _batch_where).
create or replace function pgque._batch_events(
    p_queue_id integer, p_sub_id integer, p_prev pg_snapshot, p_next pg_snapshot,
    p_after bigint, p_upto bigint, p_max integer, p_ids bigint[],
    p_slot integer default null, p_slots integer default null)
returns pgque.event_template[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return pgque._run_reader(p_queue_id, p_slots, false,
                             pg_snapshot_xmax(p_prev), pg_snapshot_xmax(p_next),
                             array(select pg_snapshot_xip(p_prev)), p_next, p_sub_id, p_after,
                             p_upto, p_ids, p_slot, p_max, null, null, null);
end
$$;

-- pgque._probe_slots(queue_id, next, slots, probe_slots, subs, prevs): those of
-- probe_slots (slots of a group of slots; null: a plain consumer's 0) whose
-- batch from prevs (the same position: its last tick's snapshot) to the
-- snapshot next holds an event for subs (its subscription), ascending. One
-- statement for all of them, each slot a probe that stops at its first event.
create or replace function pgque._probe_slots(
    p_queue_id integer, p_next pg_snapshot, p_slots integer, p_probe_slots integer[],
    p_subs integer[], p_prevs pg_snapshot[])
returns integer[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    -- plpgsql, not sql: slot_of comes later in the install (65_partition.sql).
    return (select coalesce(array_agg(distinct case when p_slots is null or p_slots = 1 then 0
                                                    else pgque.slot_of(e.ev_extra1, p_slots) end),
                            '{}')
              from unnest(pgque._run_reader(p_queue_id, p_slots, true, null,
                                            pg_snapshot_xmax(p_next), null, p_next, null, null,
                                            null, null, null, null, p_probe_slots, p_subs,
                                            p_prevs)) e);
end
$$;

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
        v_events := pgque._batch_events(
            p_queue.queue_id, p_sub.sub_id,
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
            p_cur.cur_pos, null, v_ask, null, p_slot, p_slots);
    end if;

    v_count := coalesce(cardinality(v_events), 0);
    if p_max_events is not null and v_count > p_max_events then
        v_events := v_events[1:p_max_events];
        v_count := p_max_events;
    else
        p_cur.cur_end := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
    end if;
    p_cur.cur_handed := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
    perform pgque._save_cursor(p_cur);

    if v_count = 0 then
        return query select p_cur.cur_batch, null::bigint, null::timestamptz, null::integer,
                            null::text, null::text, null::text, null::bigint;
    else
        return query select p_cur.cur_batch, e.ev_id, e.ev_time, e.ev_retry, e.ev_type, e.ev_data,
                            e.ev_extra1, null::bigint
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
-- writes, for ack (one cursor) and ack_slots (69_slot_sets.sql).
create or replace function pgque._ack_cursors(p_curs pgque.cursor[])
returns boolean[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_done boolean[];
begin
    with acked as (
        select i, p_curs[i] as cur,
               (p_curs[i]).cur_end is not null
               and (p_curs[i]).cur_handed >= (p_curs[i]).cur_end as finished
          from generate_subscripts(p_curs, 1) i
    ), saved as (
        insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                                  cur_pos, cur_handed, cur_end)
        select (a.cur).cur_sub, (a.cur).cur_seq + 1,
               case when a.finished then (a.cur).cur_next_tick else (a.cur).cur_last_tick end,
               case when not a.finished then (a.cur).cur_batch end,
               case when not a.finished then (a.cur).cur_next_tick end,
               case when not a.finished then (a.cur).cur_handed end,
               case when not a.finished then (a.cur).cur_handed end,
               case when not a.finished then (a.cur).cur_end end
          from acked a
    )
    select array_agg(a.finished order by a.i) into v_done from acked a;
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
-- (pgque.batch_nack's key enforces it). Raises PQ003 if batch_id is not the
-- open batch, PQ010 if an id is null or not among the events handed out.
create or replace function pgque._nack(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor, p_batch_id bigint,
    p_ev_ids bigint[], p_reasons text[], p_retry_after interval,
    p_slot integer default null, p_slots integer default null)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_events pgque.event_template[];
    v_wanted integer;
    v_dead integer;
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    if p_retry_after is null or p_retry_after < interval '0' then
        raise exception using errcode = '22023', message = 'retry_after must not be negative';
    end if;
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return 0;
    end if;
    if array_position(p_ev_ids, null) is not null then
        raise exception using errcode = 'PQ010',
            message = format('nack: event id must not be null (batch %s)', p_batch_id);
    end if;
    if cardinality(p_reasons) not in (1, cardinality(p_ev_ids)) then
        raise exception using errcode = '22023',
            message = 'nack: give one reason, or one per event id';
    end if;
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
                          else p_reasons[i.n] end as reason
          from unnest(p_ev_ids) with ordinality i(id, n)),
    fresh as (
        insert into pgque.batch_nack (bn_sub, bn_batch, bn_ev_id)
        select distinct p_sub.sub_id, p_batch_id, a.id from asked a
        on conflict do nothing
        returning bn_ev_id),
    nacked as (
        select distinct on (e.ev_id) e.*,
               (select a.reason from asked a where a.id = e.ev_id limit 1) as reason
          from unnest(v_events) e
          join fresh f on f.bn_ev_id = e.ev_id
         order by e.ev_id, e.ev_retry desc),
    dead as (
        insert into pgque.dead_letter (dl_queue, dl_consumer, dl_sub, dl_reason, ev_id, ev_time,
                                       ev_txid, ev_retry, ev_type, ev_data, ev_extra1)
        select p_queue.queue_id, p_sub.sub_consumer, p_sub.sub_id, e.reason, e.ev_id, e.ev_time,
               e.ev_txid, e.ev_retry, e.ev_type, e.ev_data, e.ev_extra1
          from nacked e
         where e.ev_retry >= p_queue.queue_max_retries
        returning 1),
    retried as (
        insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                       ev_retry, ev_type, ev_data, ev_extra1)
        select now() + p_retry_after, p_queue.queue_id, p_sub.sub_id, e.ev_id, e.ev_time,
               e.ev_retry + 1, e.ev_type, e.ev_data, e.ev_extra1
          from nacked e
         where e.ev_retry < p_queue.queue_max_retries
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

-- pgque.receive(queue, consumer, max_events): the consumer's open batch, or
-- its next one, as pgque.batch_event rows (epoch null), at most max_events
-- of them (null: the whole batch).
-- Blocks while another session holds the same subscription's receive lock,
-- then returns the same open batch. An open batch with no events left yields
-- one row with a null ev_id; no rows means no batch is ready.
create or replace function pgque.receive(p_queue text, p_consumer text, p_max_events integer default null)
returns setof pgque.batch_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._plain_sub(p_queue, p_consumer, false);
    if not pgque._has_next_tick((v.queue).queue_id, v.cur) then
        return;  -- idle: no lock taken, nothing written
    end if;
    select v.queue, f.sub, f.cur into v
      from pgque._find_subscription(v.queue, p_consumer, true) f;
    return query select * from pgque._receive(v.queue, v.sub, v.cur, p_max_events);
end
$$;

-- pgque.ack(queue, consumer, batch_id): acks what the latest receive handed
-- out; true when that finished the batch, false when more of it remains.
create or replace function pgque.ack(p_queue text, p_consumer text, p_batch_id bigint)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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
