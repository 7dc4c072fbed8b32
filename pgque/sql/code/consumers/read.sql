-- pgque: reading a batch: the statements that pick its events, and running them.

-- pgque._slot_expr(slots): the routing formula of pgque.slot_of (slots/groups.sql)
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

-- pgque._slot_filter(slots, slot): the condition " and <routing formula of
-- slots> = <slot>" over an event row, or nothing for no slots or a group of
-- one slot (every event is in its one slot). slot is an SQL expression its
-- callers write (a parameter, a column), never caller text.
create or replace function pgque._slot_filter(p_slots integer, p_slot text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_slots is null or p_slots = 1 then ''
                else format(' and %s = %s', pgque._slot_expr(p_slots), p_slot) end
$$;

-- pgque.read_request: everything a read of events is given, as one value:
-- the batch's bounds, whose events, which of them, and for which slots. The
-- statements below name its fields (through the SQL expression of the
-- request their caller gives: the batch readers' parameter p_read, or ($1)
-- when run dynamically), so a new field is one edit here and one where it is
-- used. Three reads take one:
--   a batch      one subscription's events (one slot's when slots > 1), in
--                ev_id order, at most max_events, after < ev_id <= upto,
--                only ids when given (_read_rows);
--   a span       the same for the slots span_slots of a group of slots, with
--                the retries of their subscriptions span_subs, at most
--                max_events per slot (_span_rows, receive_slots);
--   a probe      which of span_slots have an event between probe_prevs (each
--                slot's own start) and next (_probe_rows).
create type pgque.read_request as (
    prev_xmax   xid8,          -- the snapshot at the batch's start (its last tick): xmax
    prev_xip    xid8[],        --   and its transactions in progress
    next_xmax   xid8,          -- the snapshot at its end (the next tick): xmax
    next        pg_snapshot,   --   and the whole snapshot
    sub_id      integer,       -- the subscription (a batch): its retries only
    after       bigint,        -- ev_id above this
    upto        bigint,        -- ev_id at most this (null: no bound)
    ids         bigint[],      -- only these ev_ids (null: all)
    slot        integer,       -- the slot (a batch of a slot)
    slots       integer,       -- the group's slot count (null: a plain consumer)
    max_events  integer,       -- at most this many, per slot for a span (null: all)
    span_slots  integer[],     -- a span or a probe: the slots,
    span_subs   integer[],     --   their subscriptions,
    probe_prevs pg_snapshot[], --   and for a probe, each one's start
    probe       boolean        -- a probe
);

-- pgque._dual_filter(slots, in_progress, prev_xmax, sub, slot, req): the part
-- of a read's condition that batches, spans and probes share, over an event
-- table e: one half of the dual filter (see _batch_where), the snapshot
-- req.next (below req.next_xmax), retries owned by subscription sub, and the
-- routing formula of slots equal to slot. prev_xmax, sub, slot and req are
-- SQL expressions written by pgque's statement builders, never caller text.
create or replace function pgque._dual_filter(p_slots integer, p_in_progress boolean,
                                              p_prev_xmax text, p_sub text, p_slot text,
                                              p_req text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_in_progress then 'e.ev_txid = x.txid'
                else format('e.ev_txid >= %s and e.ev_txid < %s.next_xmax', p_prev_xmax, p_req) end
           || format(' and pg_visible_in_snapshot(e.ev_txid, %s.next)', p_req)
           || format(' and (e.ev_owner is null or e.ev_owner = %s)', p_sub)
           || pgque._slot_filter(p_slots, p_slot)
$$;

-- pgque._batch_where(req, slots, in_progress): one half of the condition
-- that picks a batch's events from an event table e, as SQL text over the
-- read request req (pgque.read_request). The "dual filter": transactions not
-- visible at the batch's start are those at or above its xmax (the half
-- without in_progress) plus those in progress then, all below its xmax (the
-- half with in_progress, over x.txid, one of req.prev_xip). So the ev_txid
-- index is read for one range and a short list of ids instead of whole
-- tables. The halves are disjoint and are read as two scans, the second one
-- probe per listed id (a lateral subquery behind "offset 0", so that the
-- planner cannot turn it into a hash join over the whole slot; see
-- _read_rows): as one condition, "range or in list", a generic plan of
-- PostgreSQL 15 used the slot index for the slot alone and read every row of
-- the slot in the table. With slots above 1 the routing formula is spelled
-- out with its count as a literal, so the planner can use the tables' slot
-- index (generated/slot_index.sql) and read only the slot's rows. Built from
-- an integer only: no caller text. The batch readers (generated/batch_reader.sql)
-- hold it as static SQL; _run_reader runs it dynamically for a count they lack.
create or replace function pgque._batch_where(p_req text, p_slots integer, p_in_progress boolean)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._dual_filter(p_slots, p_in_progress, p_req || '.prev_xmax', p_req || '.sub_id',
                              p_req || '.slot', p_req)
           || format(' and e.ev_id > %1$s.after'
                     ' and (%1$s.upto is null or e.ev_id <= %1$s.upto)'
                     ' and (%1$s.ids is null or e.ev_id = any(%1$s.ids))', p_req)
$$;

-- pgque._as_array(rows): the statement that collects what the statement
-- rows returns (pgque.event_template's columns) into one array, as the
-- readers' callers take events (_run_reader runs it when a reader lacks the
-- branch), turned into values of the type only once limited, so that a piece
-- of 100 does not build the rows of the whole batch. rows is pgque's own text.
create or replace function pgque._as_array(p_rows text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select array(select row(x.*)::pgque.event_template from (%s) x)', p_rows)
$$;

-- pgque._read_rows(req, queue_id, slots): the statement that reads a batch
-- of the queue for a slot of slots (null: a plain consumer), as rows of
-- pgque.event_template's columns: the events of both halves of
-- _batch_where, each read by its own scan, in ev_id order, at most
-- req.max_events (null: all).
create or replace function pgque._read_rows(p_req text, p_queue_id integer, p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select e.* from pgque.%I e where %s'
                  ' union all'
                  ' select e.* from unnest(%s.prev_xip) as x(txid)'
                  '  cross join lateral (select e.* from pgque.%I e where %s offset 0) e'
                  ' order by ev_id limit %s.max_events',
                  pgque._event_table(p_queue_id), pgque._batch_where(p_req, p_slots, false),
                  p_req,
                  pgque._event_table(p_queue_id), pgque._batch_where(p_req, p_slots, true),
                  p_req)
$$;

-- pgque._span_rows(req, queue_id, slots, limited): the statement that
-- reads a batch of the queue for several slots of a group of slots at once
-- (receive_slots, slots/sets.sql): both halves of the batch's condition as
-- _read_rows has them, for the slots req.span_slots (the routing formula
-- of slots among them) and with the retries of any of their subscriptions
-- req.span_subs, in no particular order (the caller orders what it hands
-- out); with limited, at most req.max_events events per slot, the first by
-- ev_id, as each slot's own read has it, so that pieces of max_events do not
-- read whole batches into memory. As rows of pgque.event_template's columns.
-- Built from integers only.
create or replace function pgque._span_rows(p_req text, p_queue_id integer,
                                            p_slots integer, p_limited boolean)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select x.ev_id, x.ev_time, x.ev_txid, x.ev_owner, x.ev_retry,'
                  '       x.ev_type, x.ev_data, x.ev_extra1, x.ev_delayed_id'
                  ' from (select e.*%s'
                  '         from (select e.* from pgque.%I e where %s'
                  '               union all'
                  '               select e.* from unnest(%s.prev_xip) as x(txid)'
                  '                cross join lateral (select e.* from pgque.%I e where %s'
                  '                                     offset 0) e) e) x%s',
                  case when p_limited
                       then format(', row_number() over (partition by %s order by e.ev_id) as n',
                                   pgque._slot_expr(p_slots)) else '' end,
                  pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, false, p_req || '.prev_xmax',
                                     format('any(%s.span_subs)', p_req),
                                     format('any(%s.span_slots)', p_req), p_req),
                  p_req,
                  pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, true, p_req || '.prev_xmax',
                                     format('any(%s.span_subs)', p_req),
                                     format('any(%s.span_slots)', p_req), p_req),
                  case when p_limited then format(' where x.n <= %s.max_events', p_req) else '' end)
$$;

-- pgque._probe_rows(req, queue_id, slots): the statement that finds which
-- of the slots req.span_slots of slots have an event in their batch up to
-- the snapshot req.next: for each of them (with its subscription of
-- req.span_subs and its start of req.probe_prevs), at most one of its
-- events, found by scans (one per half of the condition) that stop at the
-- first. As rows of pgque.event_template's columns.
create or replace function pgque._probe_rows(p_req text, p_queue_id integer, p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select (p.ev).*'
                  ' from unnest(%1$s.span_slots, %1$s.span_subs, %1$s.probe_prevs) s(k, sub, prev)'
                  ' cross join lateral ((select row(e.*)::pgque.event_template as ev'
                  '                        from pgque.%2$I e where %3$s limit 1)'
                  '                     union all'
                  '                     (select row(e.*)::pgque.event_template'
                  '                        from pg_snapshot_xip(s.prev) as x(txid)'
                  '                       cross join lateral (select e.* from pgque.%2$I e'
                  '                                            where %4$s offset 0) e'
                  '                       limit 1)'
                  '                     limit 1) p',
                  p_req, pgque._event_table(p_queue_id),
                  pgque._dual_filter(p_slots, false, 'pg_snapshot_xmax(s.prev)', 's.sub', 's.k',
                                     p_req),
                  pgque._dual_filter(p_slots, true, 'pg_snapshot_xmax(s.prev)', 's.sub', 's.k',
                                     p_req))
$$;

-- pgque._cover_rows(req, queue_id): the statement that finds whether a
-- committed event of the queue is not covered by the snapshot whose xmax and
-- in-progress list req.prev_xmax and req.prev_xip hold (the ticker's probe,
-- _uncovered_events): at most one such event, by one scan of the ev_txid
-- index from xmax (in ev_txid order: a generic plan, not knowing xmax, took
-- "ev_txid >= xmax" for a third of the table and read all of it) and one
-- probe per listed id. As rows of pgque.event_template's columns. Built from
-- an integer only.
create or replace function pgque._cover_rows(p_req text, p_queue_id integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('select x.*'
                  ' from ((select e.* from pgque.%1$I e where e.ev_txid >= %2$s.prev_xmax'
                  '         order by e.ev_txid limit 1)'
                  '       union all'
                  '       (select e.* from unnest(%2$s.prev_xip) as x(txid)'
                  '         cross join lateral (select e.* from pgque.%1$I e'
                  '                              where e.ev_txid = x.txid offset 0) e limit 1)'
                  '       limit 1) x',
                  pgque._event_table(p_queue_id), p_req)
$$;

-- pgque._read_dispatch(req, queue_id, slots): the statements that serve the
-- read request req for slots (a count: the batch readers write one branch of
-- these per count), each returned as rows: the cover probe (a probe of no
-- slots), the probe, the span read (no slot, slots above 1) or the batch read.
create or replace function pgque._read_dispatch(p_req text, p_queue_id integer,
                                                p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(E'if %1$s.probe and %1$s.span_slots is null then\n'
                  '    return query %5$s;\n'
                  '    return;\n'
                  'end if;\n'
                  'if %1$s.probe then\n'
                  '    return query %2$s;\n'
                  '    return;\n'
                  'end if;\n'
                  '%3$s'
                  'return query %4$s;\n'
                  'return;\n',
                  p_req, pgque._probe_rows(p_req, p_queue_id, p_slots),
                  case when p_slots > 1
                       then format(E'if %1$s.slot is null and %1$s.max_events is null then\n'
                                   '    return query %2$s;\n'
                                   '    return;\n'
                                   'end if;\n'
                                   'if %1$s.slot is null then\n'
                                   '    return query %3$s;\n'
                                   '    return;\n'
                                   'end if;\n',
                                   p_req, pgque._span_rows(p_req, p_queue_id, p_slots, false),
                                   pgque._span_rows(p_req, p_queue_id, p_slots, true))
                       else '' end,
                  pgque._read_rows(p_req, p_queue_id, p_slots),
                  pgque._cover_rows(p_req, p_queue_id))
$$;

-- pgque._run_reader(queue_id, req): the events that the read request req
-- asks of the queue (see pgque.read_request), as one array: through the
-- queue's batch reader when it has a branch for req.slots, else as dynamic
-- SQL, the same statement with the request as its one parameter.
create or replace function pgque._run_reader(p_queue_id integer, p_req pgque.read_request)
returns pgque.event_template[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_reader text := 'pgque.' || pgque._batch_reader_name(p_queue_id);
    v_events pgque.event_template[];
    v_slots integer := coalesce(p_req.slots, 1);
begin
    -- A reader missing (dropped by hand; maintenance writes it again) is one
    -- without the branch: the dynamic statement below reads the same.
    if to_regproc(v_reader) is not null then
        execute format('select array(select r from %s($1) r)', v_reader)
           into v_events using p_req;
        -- One row of nulls: the reader has no branch for this slot count (an
        -- event always has an ev_id).
        if not (cardinality(v_events) = 1 and (v_events[1]).ev_id is null) then
            return v_events;
        end if;
    end if;
    execute pgque._as_array(
                case when p_req.probe and p_req.span_slots is null
                          then pgque._cover_rows('($1)', p_queue_id)
                     when p_req.probe then pgque._probe_rows('($1)', p_queue_id, v_slots)
                     when v_slots > 1 and p_req.slot is null
                          then pgque._span_rows('($1)', p_queue_id, v_slots,
                                                p_req.max_events is not null)
                     else pgque._read_rows('($1)', p_queue_id, v_slots) end)
       into v_events using p_req;
    return v_events;
end
$$;

-- pgque._batch_request(sub_id, prev, next, after, upto, max, ids, slot,
--                      slots): the read request (pgque.read_request) for the
-- events of a batch, in ev_id order: those of transactions visible in
-- snapshot next but not in snapshot prev, that are not retries meant for
-- another subscription, with after < ev_id <= upto (upto null: no bound),
-- at most max of them (null: all), only ids when given, and only the hash
-- class slot of slots when slots is given (the condition: _batch_where).
create or replace function pgque._batch_request(
    p_sub_id integer, p_prev pg_snapshot, p_next pg_snapshot,
    p_after bigint, p_upto bigint, p_max integer, p_ids bigint[],
    p_slot integer default null, p_slots integer default null)
returns pgque.read_request
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_req pgque.read_request;
begin
    v_req.prev_xmax := pg_snapshot_xmax(p_prev);
    v_req.prev_xip := array(select pg_snapshot_xip(p_prev));
    v_req.next_xmax := pg_snapshot_xmax(p_next);
    v_req.next := p_next;
    v_req.sub_id := p_sub_id;
    v_req.after := p_after;
    v_req.upto := p_upto;
    v_req.ids := p_ids;
    v_req.slot := p_slot;
    v_req.slots := p_slots;
    v_req.max_events := p_max;
    v_req.probe := false;
    return v_req;
end
$$;

-- pgque._batch_events(queue_id, sub_id, prev, next, after, upto, max, ids,
--                     slot, slots): the events of the batch _batch_request
-- describes, as one array.
create or replace function pgque._batch_events(
    p_queue_id integer, p_sub_id integer, p_prev pg_snapshot, p_next pg_snapshot,
    p_after bigint, p_upto bigint, p_max integer, p_ids bigint[],
    p_slot integer default null, p_slots integer default null)
returns pgque.event_template[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return pgque._run_reader(p_queue_id,
                             pgque._batch_request(p_sub_id, p_prev, p_next, p_after, p_upto,
                                                  p_max, p_ids, p_slot, p_slots));
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
declare
    v_req pgque.read_request;
begin
    v_req.next_xmax := pg_snapshot_xmax(p_next);
    v_req.next := p_next;
    v_req.slots := p_slots;
    v_req.span_slots := p_probe_slots;
    v_req.span_subs := p_subs;
    v_req.probe_prevs := p_prevs;
    v_req.probe := true;
    return (select coalesce(array_agg(distinct case when p_slots is null or p_slots = 1 then 0
                                                    else pgque.slot_of(e.ev_extra1, p_slots) end),
                            '{}')
              from unnest(pgque._run_reader(p_queue_id, v_req)) e);
end
$$;
