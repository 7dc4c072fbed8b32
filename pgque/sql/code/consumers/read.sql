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
           || pgque._slot_filter(p_slots, p_slot)
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
-- index (generated/slot_index.sql) and read only the slot's rows. Built from an
-- integer only: no caller text. The batch readers (generated/batch_reader.sql) hold
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
-- (receive_slots, slots/sets.sql): both halves of the batch's condition as
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
    -- plpgsql, not sql: slot_of is in slots/groups.sql.
    return (select coalesce(array_agg(distinct case when p_slots is null or p_slots = 1 then 0
                                                    else pgque.slot_of(e.ev_extra1, p_slots) end),
                            '{}')
              from unnest(pgque._run_reader(p_queue_id, p_slots, true, null,
                                            pg_snapshot_xmax(p_next), null, p_next, null, null,
                                            null, null, null, null, p_probe_slots, p_subs,
                                            p_prevs)) e);
end
$$;
