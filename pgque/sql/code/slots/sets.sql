-- pgque: receiving and acking several slots of a group in one call.
--
-- A session that owns many slots (a worker with few lanes, a consumer that
-- drains a whole group) would otherwise make a receive and an ack per slot:
-- two round trips, two commits and the queue and group lookups, times the
-- slots. These do the same per slot, with the same checks, in one statement
-- each, as Kafka's poll returns the records of every assigned partition.
-- Each slot's piece is the one receive_partitioned would return; nothing
-- about order or ownership changes.
--
-- The usual case is set-based: slots drained together sit at the same tick
-- with no open batch, so their next batches span the same two ticks, and one
-- read of that span (the batch reader's span read, each event routed to its
-- slot with the routing formula) holds every slot's events; their cursors
-- are written in one statement, and when every slot asked for goes
-- together, their epochs and locks are taken in one statement each too. A
-- slot at another position, with an open batch, or with nothing in that span
-- (whose empty batches receive_partitioned consumes, or whose idle poll it
-- leaves unwritten) takes the slot-by-slot path instead, and so do all of
-- them when they are less than half of the group (the read of the whole span
-- would then cost more than theirs). Both paths hand out the same pieces
-- (tests/test_slot_sets_model.py).

-- pgque.slot_event: a row of receive_slots, a slot's event (or batch) row led by the slot.
create type pgque.slot_event as (
    slot      integer,
    batch_id  bigint,
    ev_id     bigint,
    ev_time   timestamptz,
    ev_retry  integer,
    ev_type   text,
    ev_data   text,
    ev_extra1 text,
    epoch     bigint
);

-- pgque.receive_slots(queue, consumer, slots, slot_list, max_events): for each
-- slot of slot_list (slots of a group of slots), what receive_partitioned
-- would return, as rows led by the slot, ascending by slot; slots with
-- nothing to receive return no row. One transaction: a failure (PQ024 for a
-- slot this session does not own) receives nothing. max_events bounds each
-- slot's piece.
create or replace function pgque.receive_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_max_events integer default null)
returns setof pgque.slot_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_ks integer[];
    v_subs pgque.subscription[];
    v_curs pgque.cursor[];
    v_last_tick bigint;
    v_together integer[];            -- positions of the slots that can go together
    v_span_ks integer[];             -- those slots, and their subscriptions' ids
    v_span_subs integer[];
    v_prev pg_snapshot;              -- the snapshot of their last tick
    v_next_tick bigint;              -- the tick that closes their next batches
    v_next pg_snapshot;
    v_events pgque.event_template[]; -- those batches' events, in ev_id order
    v_routes integer[];              -- each event's slot among them (-1: none)
    v_with integer[];                -- the slots that have events, ascending, and for each:
    v_counts bigint[];               --   how many,
    v_lasts bigint[];                --   the last one's ev_id,
    v_handed bigint[];               --   the ev_id of the last one of the first piece
    v_epoch bigint;
    v_locked record;
    v_cur pgque.cursor;
    v_open integer[] := '{}';        -- the slots opened together
    v_all boolean := false;          -- all of them in one statement each
    v_epochs bigint[] := '{}';
    v_open_curs pgque.cursor[] := '{}';
    v_rest pgque.slot_event[] := '{}';
    v_i integer;
begin
    perform pgque._check_max_events(p_max_events);
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    select array_agg(t.slot order by t.slot), array_agg(t.sub order by t.slot),
           array_agg(t.cur order by t.slot)
      into v_ks, v_subs, v_curs
      from pgque._slot_subs(v_queue, v_group, p_slot_list) t;
    if v_ks is null then
        return;  -- an empty list
    end if;
    -- Every slot owned before anything is received (receive_partitioned's
    -- first check, for all of them).
    for v_i in 1 .. cardinality(v_ks) loop
        perform pgque._require_owner(v_subs[v_i]);
    end loop;
    -- The slots that can go together: no open batch, at the last tick most of
    -- them share, with events in their next batch, read once before any lock.
    select c.cur_last_tick into v_last_tick
      from unnest(v_curs) c where c.cur_batch is null
     group by c.cur_last_tick order by count(*) desc, c.cur_last_tick limit 1;
    if v_last_tick is not null then
        v_together := array(select i from generate_subscripts(v_ks, 1) i
                             where (v_curs[i]).cur_batch is null
                               and (v_curs[i]).cur_last_tick = v_last_tick order by i);
        -- The read together covers the whole batch: for less than half of the
        -- group's slots, reading each slot's own rows (its slot index) is less.
        -- (A group of one slot has nothing to put together.)
        if v_group.cg_slots > 1 and cardinality(v_together) * 2 >= v_group.cg_slots then
            v_next_tick := pgque._next_tick(v_queue, v_curs[v_together[1]]);
            v_prev := pgque._tick_snapshot(v_queue.queue_id, v_last_tick);
        end if;
    end if;
    if v_next_tick is not null and v_prev is not null then
        v_next := pgque._tick_snapshot(v_queue.queue_id, v_next_tick);
        v_span_ks := array(select v_ks[i] from unnest(v_together) i);
        v_span_subs := array(select (v_subs[i]).sub_id from unnest(v_together) i);
        -- One read of their next batch (_span_statement) ...
        v_events := pgque._run_reader(
            v_queue.queue_id, v_group.cg_slots, false, pg_snapshot_xmax(v_prev),
            pg_snapshot_xmax(v_next), array(select pg_snapshot_xip(v_prev)), v_next, null, null,
            null, null, null, pgque._events_asked(p_max_events), v_span_ks, v_span_subs, null);
        -- ... each event routed by slot_of's formula, written out (a call per
        -- event would cost more than the rest of this), a retried event to its
        -- owner's slot only; and what each slot's cursor needs to know.
        with routed as materialized (
            select e.ordinality as i, e.ev_id, coalesce(o.k, -1) as k
              from unnest(v_events) with ordinality as e
              left join unnest(v_span_ks, v_span_subs) as o(k, sub)
                on o.k = case when e.ev_extra1 is null then 0
                              else (hashtextextended(e.ev_extra1, 0) % v_group.cg_slots
                                    + v_group.cg_slots) % v_group.cg_slots end
               and (e.ev_owner is null or e.ev_owner = o.sub)
        ), per_slot as (
            select r.k, count(*) as n, max(r.ev_id) as last,
                   coalesce((array_agg(r.ev_id order by r.ev_id))[p_max_events],
                            max(r.ev_id)) as handed
              from routed r
             where r.k >= 0
             group by r.k
        )
        select (select array_agg(r.k order by r.i) from routed r),
               array_agg(p.k order by p.k), array_agg(p.n order by p.k),
               array_agg(p.last order by p.k), array_agg(p.handed order by p.k)
          into v_routes, v_with, v_counts, v_lasts, v_handed
          from per_slot p;
        v_together := array(select i from unnest(v_together) i where v_ks[i] = any(v_with));
    else
        v_together := '{}';
    end if;
    if cardinality(v_together) = cardinality(v_ks) then
        -- Every slot goes together (a session draining its slots): the epochs,
        -- the locks (ascending by slot) and the cursors read once locked, one
        -- statement each, with the checks of the slot-by-slot path below.
        v_epochs := pgque._slot_epochs(v_subs);
        if array_position(v_epochs, null) is null then
            -- The owner checked on the rows as locked: the key may have been
            -- renewed (and the slot taken) since they were read.
            for v_locked in select s from generate_subscripts(v_subs, 1) i
                              join pgque.subscription s on s.sub_id = (v_subs[i]).sub_id
                             order by i
                               for update of s loop
                perform pgque._require_owner(v_locked.s);
            end loop;
            v_open_curs := array(select c.c from generate_subscripts(v_subs, 1) i
                                  cross join lateral (select o from pgque.cursor o
                                                       where o.cur_sub = (v_subs[i]).sub_id
                                                       order by o.cur_seq desc limit 1) c(c)
                                  where (c.c).cur_batch is null
                                    and (c.c).cur_last_tick = v_last_tick
                                  order by i);
            v_all := cardinality(v_open_curs) = cardinality(v_ks);
        end if;
        if v_all then
            v_open := v_ks;
        else
            -- A fenced slot, or a cursor that moved: slot by slot below.
            v_epochs := '{}';
            v_open_curs := '{}';
        end if;
    end if;
    -- Slot after slot, ascending (the lock order everywhere): a slot that can
    -- go together is locked here and opened with the others below; any other
    -- goes as receive_partitioned would take it.
    for v_i in 1 .. cardinality(v_ks) loop
        exit when v_all;  -- all opened together above
        if v_i = any(v_together) then
            -- As _receive_slot: the epoch before the receive lock (null while a
            -- transaction fenced by the previous owner's epoch is open: then
            -- the slot receives nothing), the owner again once locked, and the
            -- cursor read again (a new statement, so a fresh snapshot).
            v_epoch := pgque._slot_epoch(v_subs[v_i]);
            if v_epoch is null then
                continue;
            end if;
            select s into v_locked from pgque.subscription s
             where s.sub_id = (v_subs[v_i]).sub_id for update;
            perform pgque._require_owner(v_locked.s);  -- as locked: the key may be new
            v_cur := pgque._current_cursor((v_subs[v_i]).sub_id);
            if v_cur.cur_batch is null and v_cur.cur_last_tick = v_last_tick then
                v_open := v_open || v_ks[v_i];
                v_epochs := v_epochs || v_epoch;
                v_open_curs := v_open_curs || v_cur;
                continue;
            end if;
        end if;
        v_rest := v_rest || array(
            select row(v_ks[v_i], r.batch_id, r.ev_id, r.ev_time, r.ev_retry, r.ev_type,
                       r.ev_data, r.ev_extra1, r.epoch)::pgque.slot_event
              from pgque._receive_slot(v_queue, v_group, v_ks[v_i], v_subs[v_i], v_curs[v_i],
                                       p_max_events) r);
    end loop;
    -- Opens the batch of each slot that goes together, as _receive does for
    -- one slot (a batch id, at most max_events events, the batch's end once it
    -- was read whole), with one cursor write for them all; then the rows of
    -- the others, all by slot and then ev_id.
    return query
        with served as (
            select t.k, t.epoch, t.n, nextval('pgque.batch_id_seq') as batch_id,
                   v_counts[j.j] as count, v_lasts[j.j] as last, v_handed[j.j] as handed
              from unnest(v_open, v_epochs) with ordinality as t(k, epoch, n)
             cross join lateral (select array_position(v_with, t.k) as j) j
        ), saved as (
            insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                                      cur_pos, cur_handed, cur_end)
            select (v_open_curs[s.n]).cur_sub, (v_open_curs[s.n]).cur_seq + 1,
                   (v_open_curs[s.n]).cur_last_tick, s.batch_id, v_next_tick, 0, s.handed,
                   case when p_max_events is null or s.count <= p_max_events then s.last end
              from served s
        )
        select s.k, s.batch_id, e.ev_id, e.ev_time, e.ev_retry, e.ev_type, e.ev_data,
               e.ev_extra1, s.epoch
          from unnest(v_events) with ordinality as e
          join served s on s.k = v_routes[e.ordinality]
         where e.ev_id <= s.handed
        union all
        select x.* from unnest(v_rest) x
         order by 1, 3;
end
$$;

-- pgque.ack_slots(queue, consumer, slots, slot_list, batch_ids): acks, for each
-- slot of slot_list, the batch piece batch_ids names at the same position
-- (what ack_partitioned does for one), in one transaction, slots locked in
-- ascending order; returns, in the order given, whether each ack finished
-- its batch. Raises 22023 for a null list, a slot named twice or lists of
-- different lengths, PQ023 for a slot out of range, PQ024 for a slot this
-- session does not own, PQ003 for a batch that is not the slot's open one:
-- then nothing is acked.
create or replace function pgque.ack_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_batch_ids bigint[])
returns boolean[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_subs pgque.subscription[];
    v_curs pgque.cursor[];
    v_batch_ids bigint[];
    v_positions bigint[];
    v_done boolean[];
    v_i integer;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    perform pgque._check_slot_list(v_group, p_slot_list);
    if p_batch_ids is null or cardinality(p_slot_list) <> cardinality(p_batch_ids) then
        raise exception using errcode = '22023',
            message = 'ack_slots: the batch ids must be as many as the slots';
    end if;
    -- The receive locks, in ascending slot order, in one statement; then (a
    -- new statement, so a fresh snapshot) the subscriptions and cursors, and
    -- for each slot ack_partitioned's checks.
    perform 1 from unnest(p_slot_list) k
      join pgque.subscription s
        on s.sub_queue = v_queue.queue_id
       and s.sub_consumer = pgque._slot_name(p_consumer, k, v_group.cg_slots)
     order by k
       for update of s;
    select array_agg(t.sub order by t.slot), array_agg(t.cur order by t.slot),
           array_agg(b.batch_id order by t.slot), array_agg(b.pos order by t.slot)
      into v_subs, v_curs, v_batch_ids, v_positions
      from pgque._slot_subs(v_queue, v_group, p_slot_list) t
      join unnest(p_slot_list, p_batch_ids) with ordinality as b(slot, batch_id, pos)
        on b.slot = t.slot;
    if v_subs is null then
        return '{}';  -- an empty list
    end if;
    for v_i in 1 .. cardinality(v_subs) loop
        perform pgque._require_owner(v_subs[v_i]);
        perform pgque._require_batch(v_subs[v_i], v_curs[v_i], v_batch_ids[v_i]);
    end loop;
    -- What _ack writes for one slot, for all of them in one statement; each
    -- result goes where the slot was given.
    v_done := pgque._ack_cursors(v_curs);
    select array_agg(v_done[t.i] order by v_positions[t.i]) into v_done
      from generate_subscripts(v_curs, 1) t(i);
    return v_done;
end
$$;
