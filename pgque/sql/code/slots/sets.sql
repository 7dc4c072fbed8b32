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
-- The usual case is set-based: slots drained together have no open batch
-- and their next batches end at the same tick (the queue's newest, as a rule),
-- even when they start at different ticks (a slot that found nothing in the
-- last ticks leaves its cursor where it was: see _slot_read_ahead). One read
-- of the span from the oldest of their starts holds every slot's events; each
-- event is routed to its slot with the routing formula, and kept for it only
-- if it came after that slot's own start; their cursors are written in one
-- statement, and when every slot asked for goes together, their epochs and
-- locks are taken in one statement each too. A slot with nothing in its span
-- that receive_partitioned would leave unwritten (the idle rule of
-- _slot_read_ahead) costs nothing more. A slot with an open batch, whose
-- batch would end at another tick, with blocked keys, or with nothing in its
-- span that receive_partitioned would consume, takes the slot-by-slot path
-- instead, and so do all of them when they are less than half of the group
-- (the read of the whole span would then cost more than theirs). Both paths
-- hand out the same pieces and write the same cursors
-- (tests/test_slot_sets_model.py).

-- pgque._owned_slot_subs(queue, grp, slot_list): the slots of slot_list
-- ascending (ks), with their subscriptions and cursors as _slot_subs reads
-- them (nulls for an empty list), each slot owned by this session (PQ024 for
-- the first that is not: receive_partitioned's first check, for all of them,
-- before anything is received).
create or replace function pgque._owned_slot_subs(
    p_queue pgque.queue, p_group pgque.consumer_group, p_slot_list integer[],
    out ks integer[], out subs pgque.subscription[], out curs pgque.cursor[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    select array_agg(t.slot order by t.slot), array_agg(t.sub order by t.slot),
           array_agg(t.cur order by t.slot)
      into ks, subs, curs
      from pgque._slot_subs(p_queue, p_group, p_slot_list) t;
    perform pgque._require_owner(subs[i]) from generate_subscripts(subs, 1) i;
end
$$;

-- pgque._slot_span(queue, grp, ks, subs, curs, max_events): the plan of
-- the set-based path of receive_slots for slots ks of group grp (their
-- subscriptions and cursors as read without a lock): which of them can go
-- together, and the one read of their next batch. Those that can: no open
-- batch, and the tick that would end their next batch (_next_tick: next_tick)
-- the one most of them share, and only when they are at least half of the
-- group (else each slot's own read, by its slot index, costs less). together
-- holds their positions in ks (none: the read is null), lasts their last
-- ticks at the same positions; last_tick is the oldest of those. req is the
-- read request of their span from last_tick (_span_rows), which the
-- caller runs and routes (_route_span); when their last ticks differ it
-- carries each slot's start in probe_prevs (an event is a slot's only if
-- that snapshot did not see it) and reads the span whole.
create or replace function pgque._slot_span(
    p_queue pgque.queue, p_group pgque.consumer_group, p_ks integer[],
    p_subs pgque.subscription[], p_curs pgque.cursor[], p_max_events integer,
    out together integer[], out lasts bigint[], out last_tick bigint, out next_tick bigint,
    out req pgque.read_request)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_prev pg_snapshot;              -- the snapshot of their oldest last tick
    v_next pg_snapshot;
    v_newest pgque.tick := pgque._last_tick(p_queue.queue_id);
begin
    together := '{}';
    -- (A group of one slot has nothing to put together.)
    if p_group.cg_slots = 1 then
        return;
    end if;
    -- The tick ending each slot's next batch, computed once per distinct last
    -- tick (slots share a few); the slots of the one most of them share.
    with c as (select i, (p_curs[i]).cur_last_tick as lt
                 from generate_subscripts(p_ks, 1) i
                where (p_curs[i]).cur_batch is null),
         n as (select d.lt,
                      -- _next_tick's answer, in the usual case (the newest tick
                      -- is within ticker_max_count) without its range scan.
                      case when d.lt >= v_newest.tick_id then null
                           when v_newest.tick_event_seq
                                <= l.tick_event_seq + p_queue.queue_ticker_max_count
                           then v_newest.tick_id
                           else pgque._next_tick(p_queue, p_curs[d.i]) end as n
                 from (select c.lt, min(c.i) as i from c group by c.lt) d
                 -- (lateral: one probe of the tick's key per last tick, where a
                 -- join could read every tick)
                 left join lateral (select l.tick_event_seq from pgque.tick l
                                     where l.tick_queue = p_queue.queue_id
                                       and l.tick_id = d.lt) l on true)
    select array_agg(c.i order by c.i), n.n into together, next_tick
      from c join n on n.lt = c.lt
     where n.n is not null
     group by n.n order by count(*) desc, n.n desc limit 1;
    if together is null or cardinality(together) * 2 < p_group.cg_slots then
        together := '{}';
        return;
    end if;
    lasts := array(select (p_curs[i]).cur_last_tick from unnest(together) with ordinality t(i, o)
                    order by o);
    last_tick := (select min(l) from unnest(lasts) l);
    v_prev := pgque._tick_snapshot(p_queue.queue_id, last_tick);
    if v_prev is null then
        together := '{}';
        return;
    end if;
    v_next := pgque._tick_snapshot(p_queue.queue_id, next_tick);
    -- One read of their next batches, for the caller to run.
    req.prev_xmax := pg_snapshot_xmax(v_prev);
    req.prev_xip := array(select pg_snapshot_xip(v_prev));
    req.next_xmax := pg_snapshot_xmax(v_next);
    req.next := v_next;
    req.slots := p_group.cg_slots;
    req.max_events := pgque._events_asked(p_max_events);
    req.span_slots := array(select p_ks[i] from unnest(together) i);
    req.span_subs := array(select (p_subs[i]).sub_id from unnest(together) i);
    req.probe := false;
    if exists (select from unnest(lasts) l where l <> last_tick) then
        req.probe_prevs := array(select k.tick_snapshot
                                   from unnest(lasts) with ordinality t(l, o)
                                   join pgque.tick k on k.tick_queue = p_queue.queue_id
                                                    and k.tick_id = t.l
                                  order by t.o);
        -- Read whole: a slot's first max_events of the span may be events an
        -- older start holds and its own start saw.
        req.max_events := null;
    end if;
end
$$;

-- pgque._route_span(events, req, max_events): the span's events (read for the
-- read request req of _slot_span) routed to their slots: each event's slot
-- among req.span_slots by slot_of's formula, written out (a call per event
-- would cost more than the rest of receive_slots), a retried event to its
-- owner's slot only, an event to a slot only if the slot's start
-- (req.probe_prevs, when given) did not see it (-1: none of them); the slots that have events, ascending,
-- and for each how many, the last one's ev_id and the last ev_id of the first
-- piece (max_events; without it, the last one). The events come as an
-- argument, not in a record: they are read once per row below.
create or replace function pgque._route_span(
    p_events pgque.event_template[], p_req pgque.read_request, p_max_events integer,
    out routes integer[], out with_events integer[], out counts bigint[], out lasts bigint[],
    out handed bigint[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_slots integer := p_req.slots;
    v_span_slots integer[] := p_req.span_slots;
    v_span_subs integer[] := p_req.span_subs;
begin
    if coalesce(cardinality(p_events), 0) = 0 then
        return;  -- nothing to route (an idle poll): no query
    end if;
    routes := array(
        select coalesce(o.k, -1)
          from unnest(p_events) with ordinality as e
          left join unnest(v_span_slots, v_span_subs, p_req.probe_prevs) as o(k, sub, prev)
            on o.k = case when e.ev_extra1 is null then 0
                          else (hashtextextended(e.ev_extra1, 0) % v_slots
                                + v_slots) % v_slots end
           and (e.ev_owner is null or e.ev_owner = o.sub)
           and (o.prev is null or not pg_visible_in_snapshot(e.ev_txid, o.prev))
         order by e.ordinality);
    select array_agg(p.k order by p.k), array_agg(p.n order by p.k),
           array_agg(p.last order by p.k)
      into with_events, counts, lasts
      from (select routes[e.ordinality] as k, count(*) as n, max(e.ev_id) as last
              from unnest(p_events) with ordinality as e
             where routes[e.ordinality] >= 0
             group by 1) p;
    -- Each slot's piece ends at its last event, or at its max_events-th by
    -- ev_id when it has more (pieces: only then are the events ordered).
    handed := lasts;
    if p_max_events < any(counts) then
        handed := array(
            select coalesce(m.ev_id, w.last)
              from unnest(with_events, lasts) with ordinality as w(k, last, i)
              left join (select r.k, r.ev_id
                           from (select routes[e.ordinality] as k, e.ev_id,
                                        row_number() over (partition by routes[e.ordinality]
                                                           order by e.ev_id) as n
                                   from unnest(p_events) with ordinality as e
                                  where routes[e.ordinality] >= 0) r
                          where r.n = p_max_events) m on m.k = w.k
             order by w.i);
    end if;
end
$$;

-- pgque._lock_span(subs, last_ticks): for a set-based receive of every slot of
-- subs at once: their epochs (_slot_epochs), then their receive locks in
-- ascending slot order with the owner checked on each row as locked (PQ024:
-- the key may have been renewed and the slot taken since the rows were read),
-- then their cursors read again; null unless every slot can go (none fenced,
-- every cursor still without an open batch at its tick of last_ticks).
create or replace function pgque._lock_span(
    p_subs pgque.subscription[], p_last_ticks bigint[],
    out epochs bigint[], out curs pgque.cursor[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_locked record;
    v_parts record;
begin
    epochs := pgque._slot_epochs(p_subs);
    if array_position(epochs, null) is not null then
        epochs := null;
        return;
    end if;
    for v_locked in select s from generate_subscripts(p_subs, 1) i
                      join pgque.subscription s on s.sub_id = (p_subs[i]).sub_id
                     order by i
                       for no key update of s loop
        perform pgque._require_owner(v_locked.s);
    end loop;
    perform pgque._write_part('cursor');  -- 40001 for a snapshot older than a switch
    v_parts := pgque._cursor_parts();
    -- _current_cursor, written out (as in _slot_subs).
    curs := array(select coalesce(c1.c, c2.c) from generate_subscripts(p_subs, 1) i
                   left join lateral (select o from pgque.cursor o
                                       where o.cur_part = v_parts.part
                                         and o.cur_sub = (p_subs[i]).sub_id
                                       order by o.cur_seq desc limit 1) c1(c) on true
                   left join lateral (select o from pgque.cursor o
                                       where c1.c is null and o.cur_part = v_parts.moved_from
                                         and o.cur_sub = (p_subs[i]).sub_id
                                       order by o.cur_seq desc limit 1) c2(c) on true
                   where (coalesce(c1.c, c2.c)).cur_batch is null
                     and (coalesce(c1.c, c2.c)).cur_last_tick = p_last_ticks[i]
                   order by i);
    if cardinality(curs) <> cardinality(p_subs) then
        epochs := null;
        curs := null;
    end if;
end
$$;

-- pgque._lock_span_slot(sub, last_tick): as _lock_span for one slot that
-- goes together with others while some slot of the call does not: its epoch
-- before its receive lock (null while a transaction fenced by the previous
-- owner's epoch is open: then the slot receives nothing), the owner again once
-- locked, and its cursor read again (a new statement, so a fresh snapshot);
-- ready unless the cursor moved since it was read (the slot then goes as
-- receive_partitioned would take it).
create or replace function pgque._lock_span_slot(
    p_sub pgque.subscription, p_last_tick bigint,
    out epoch bigint, out cur pgque.cursor, out ready boolean)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_locked record;
begin
    ready := false;
    epoch := pgque._slot_epoch(p_sub);
    if epoch is null then
        return;
    end if;
    select s into v_locked from pgque.subscription s where s.sub_id = p_sub.sub_id
       for no key update;
    perform pgque._require_owner(v_locked.s);  -- as locked: the key may be new
    cur := pgque._current_cursor(p_sub.sub_id);
    ready := coalesce(cur.cur_batch is null and cur.cur_last_tick = p_last_tick, false);
end
$$;

-- pgque.receive_slots(queue, consumer, slots, slot_list, max_events): for each
-- slot of slot_list (slots of a group of slots), what receive_partitioned
-- would return, ascending by slot; slots with nothing to receive return no
-- row. One transaction: a failure (PQ024 for a slot this session does not
-- own) receives nothing. max_events bounds each slot's piece. The rows are
-- pgque.batch_event's columns led by the slot, as clients of 0.3 read them
-- by position, then (since 0.8) ahead: whether the slot has more to receive
-- once this piece is acked (its batch goes on after the piece, or ends before
-- the queue's newest tick): a consumer draining a backlog receives again at
-- once; one that is not waits for the next tick.
create or replace function pgque.receive_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_max_events integer default null)
returns table (slot integer, batch_id bigint, ev_id bigint, ev_time timestamptz,
               ev_retry integer, ev_type text, ev_data text, ev_extra1 text, epoch bigint,
               delayed_id bigint, ahead boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_ks integer[];
    v_subs pgque.subscription[];
    v_curs pgque.cursor[];
    v_span record;                   -- _slot_span: the slots together and their read
    v_events pgque.event_template[]; -- that read's events,
    v_route record;                  --   routed to their slots (_route_span)
    v_locked record;
    v_all boolean := false;          -- every slot opened together
    v_open integer[] := '{}';        -- the slots opened together, their epochs and cursors
    v_epochs bigint[] := '{}';
    v_open_curs pgque.cursor[] := '{}';
    v_served record;                 -- their batches (_open_span_batches)
    v_routes integer[];
    v_batch_ids bigint[];
    v_handed bigint[];
    v_rest pgque.batch_event[] := '{}';  -- the rows of the other slots
    v_idle integer[] := '{}';        -- positions in ks of the slots left idle
    v_lasts bigint[];                -- the last ticks of the slots together
    v_newest pgque.tick;
    v_blocked integer[];             -- the subscriptions among them with a blocked key
    v_ahead integer[];               -- the slots of v_rest whose batch ends before the newest tick
    v_i integer;
    v_j integer;
begin
    perform pgque._check_max_events(p_max_events);
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    select * into v_ks, v_subs, v_curs from pgque._owned_slot_subs(v_queue, v_group, p_slot_list);
    if v_ks is null then
        return;  -- an empty list
    end if;
    -- A slot with no open batch, no tick after its last one and no blocked key
    -- has nothing to receive: as receive_partitioned does (_has_next_tick),
    -- it is left without a lock or a write. (Held events are due only where
    -- a key is blocked: see _held_due.)
    v_newest := pgque._last_tick(v_queue.queue_id);
    v_blocked := array(select distinct b.bk_sub from pgque.blocked_key b
                        where b.bk_sub = any(array(select (x).sub_id from unnest(v_subs) x)));
    v_idle := array(select i from generate_subscripts(v_ks, 1) i
                     where (v_curs[i]).cur_batch is null
                       and (v_curs[i]).cur_last_tick >= coalesce(v_newest.tick_id, 0)
                       and (v_subs[i]).sub_id <> all(v_blocked)
                     order by i);
    v_span := pgque._slot_span(v_queue, v_group, v_ks, v_subs, v_curs, p_max_events);
    if cardinality(v_span.together) > 0 then
        v_events := pgque._run_reader(v_queue.queue_id, v_span.req);
        v_route := pgque._route_span(v_events, v_span.req, p_max_events);
        -- A slot with nothing in its span is left as receive_partitioned
        -- leaves an idle slot (_slot_read_ahead's rule: its batch would end
        -- at the newest tick, its start is recent, no held events due):
        -- nothing received, nothing written. The other empty ones, and a slot
        -- with blocked keys (slots/pause.sql: its receive sets their events
        -- aside, or hands out held ones), go slot by slot.
        select v_idle || coalesce(array_agg(t.i order by t.o) filter (where t.idle), '{}'),
               coalesce(array_agg(t.i order by t.o) filter (where not t.idle and t.go), '{}'),
               coalesce(array_agg(t.l order by t.o) filter (where not t.idle and t.go), '{}')
          into v_idle, v_span.together, v_lasts
          from (select x.i, x.o, x.l, x.has and not x.blocked as go,
                       not x.has and not x.blocked and v_span.next_tick = v_newest.tick_id
                           and now() - k.tick_time < pgque._slot_cursor_lag() as idle
                  from (select t.i, t.o, t.l,
                               coalesce(v_ks[t.i] = any(v_route.with_events), false) as has,
                               (v_subs[t.i]).sub_id = any(v_blocked) as blocked
                          from unnest(v_span.together, v_span.lasts) with ordinality t(i, l, o)) x
                  left join pgque.tick k on k.tick_queue = v_queue.queue_id and k.tick_id = x.l
               ) t;
    else
        v_route := pgque._route_span('{}', null, null);  -- nothing to route
    end if;
    if cardinality(v_span.together) + cardinality(v_idle) = cardinality(v_ks)
       and cardinality(v_span.together) > 0 then
        -- Every slot goes together or is idle (a session draining its slots):
        -- one statement each for the epochs, the locks and the cursors.
        v_locked := pgque._lock_span(array(select v_subs[i] from unnest(v_span.together) i),
                                     v_lasts);
        if v_locked.epochs is not null then
            v_all := true;
            v_open := array(select v_ks[i] from unnest(v_span.together) i);
            v_epochs := v_locked.epochs;
            v_open_curs := v_locked.curs;
        end if;
    end if;
    -- Else slot after slot, ascending (the lock order everywhere): a slot that
    -- can go together is locked here and opened with the others below; an
    -- idle one is left; any other goes as receive_partitioned would take it.
    for v_i in 1 .. cardinality(v_ks) loop
        exit when v_all;  -- all opened together above
        continue when v_i = any(v_idle);
        v_j := array_position(v_span.together, v_i);
        if v_j is not null then
            v_locked := pgque._lock_span_slot(v_subs[v_i], v_lasts[v_j]);
            continue when v_locked.epoch is null;  -- fenced: nothing for this slot
            if v_locked.ready then
                v_open := v_open || v_ks[v_i];
                v_epochs := v_epochs || v_locked.epoch;
                v_open_curs := v_open_curs || v_locked.cur;
                continue;
            end if;
        end if;
        v_rest := v_rest || array(
            select r from pgque._receive_slot(v_queue, v_group, v_ks[v_i], v_subs[v_i],
                                              v_curs[v_i], p_max_events) r);
    end loop;
    -- The pieces of the slots opened together, read from the span's events
    -- (the arrays in variables: a record's field would be fetched per row),
    -- then the rows of the others, by slot and ev_id.
    if cardinality(v_open) > 0 then
        v_served := pgque._open_span_batches(v_route.with_events, v_route.counts, v_route.lasts,
                                             v_route.handed, v_span.next_tick, v_open,
                                             v_open_curs, p_max_events);
        v_routes := v_route.routes;
        v_batch_ids := v_served.batch_ids;
        v_handed := v_served.handed;
    end if;
    -- Ahead: the slot's batch goes on after this piece (max_events cut it),
    -- or ends before the newest tick. The batches opened together end at the
    -- span's tick; the others where their cursors now say (a piece of held
    -- events: no tick, ahead).
    v_ahead := array(select k from (select distinct x.slot as k from unnest(v_rest) x) r
                     cross join lateral pgque._current_cursor(
                         (v_subs[array_position(v_ks, r.k)]).sub_id, false) c
                     where coalesce(c.cur_next_tick < v_newest.tick_id
                                    or c.cur_end is null or c.cur_handed < c.cur_end, true));
    return query
        select s.k, s.batch_id, e.ev_id, e.ev_time, e.ev_retry, e.ev_type, e.ev_data,
               e.ev_extra1, s.epoch, e.ev_delayed_id,
               v_span.next_tick < v_newest.tick_id
               or v_route.counts[array_position(v_route.with_events, s.k)] > p_max_events
          from unnest(v_events) with ordinality as e
          join unnest(v_open, v_batch_ids, v_handed, v_epochs) as s(k, batch_id, handed, epoch)
            on s.k = v_routes[e.ordinality]
         where e.ev_id <= s.handed
        union all
        select x.slot, x.batch_id, x.ev_id, x.ev_time, x.ev_retry, x.ev_type, x.ev_data,
               x.ev_extra1, x.epoch, x.delayed_id, x.slot = any(v_ahead)
          from unnest(v_rest) x
         order by 1, 3;
end
$$;

-- pgque._open_span_batches(route, next_tick, open, epochs, curs, max_events):
-- opens the batch of each slot of open (with epochs and locked cursors curs,
-- at the same positions) over the span's read, as _slot_span planned it (its
-- routing by _route_span, and next_tick), as _receive does for one slot (a
-- batch id, a piece of at most max_events events, the batch's end once it
-- was read whole), with one cursor write for them all; returns, for each slot
-- of open, its batch id and the ev_id of its piece's last event. The caller
-- reads the rows of the pieces from the span's events.
create or replace function pgque._open_span_batches(
    p_with integer[], p_counts bigint[], p_lasts bigint[], p_handed bigint[],
    p_next_tick bigint, p_open integer[], p_curs pgque.cursor[], p_max_events integer,
    out batch_ids bigint[], out handed bigint[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_saved integer;
begin
    with served as (
        select t.n, nextval('pgque.batch_id_seq') as batch_id,
               p_counts[j.j] as count, p_lasts[j.j] as last, p_handed[j.j] as handed
          from unnest(p_open) with ordinality as t(k, n)
         cross join lateral (select array_position(p_with, t.k) as j) j
    ), saved as (
        insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                                  cur_pos, cur_handed, cur_end, cur_part)
        select (p_curs[s.n]).cur_sub, (p_curs[s.n]).cur_seq + 1,
               (p_curs[s.n]).cur_last_tick, s.batch_id, p_next_tick, 0, s.handed,
               case when p_max_events is null or s.count <= p_max_events then s.last end,
               (select pgque._write_part('cursor'))
          from served s
        on conflict do nothing
        returning 1
    )
    select array_agg(s.batch_id order by s.n), array_agg(s.handed order by s.n),
           (select count(*) from saved)
      into batch_ids, handed, v_saved
      from served s;
    if v_saved < coalesce(cardinality(p_open), 0) then
        perform pgque._cursor_moved();  -- a cursor written since it was read
    end if;
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
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_subs pgque.subscription[];
    v_curs pgque.cursor[];
    v_batch_ids bigint[];
    v_positions bigint[];
    v_done boolean[];
    v_held integer[] := '{}';  -- the positions of pieces of held events
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
       -- _slot_name, written out (as in _slot_subs)
       and s.sub_consumer = v_group.cg_consumer || '#' || k::text || '/'
                            || v_group.cg_slots::text
     order by k
       for no key update of s;
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
        if (v_curs[v_i]).cur_sub is null then
            perform pgque._cursor_missing((v_subs[v_i]).sub_id);  -- 40001: an old snapshot
        end if;
        if v_batch_ids[v_i] is distinct from (v_curs[v_i]).cur_batch
           and exists (select from pgque.blocked_key b
                        where b.bk_sub = (v_subs[v_i]).sub_id
                          and b.bk_batch = v_batch_ids[v_i]) then
            v_held := v_held || v_i;  -- a piece of held events (slots/pause.sql)
        else
            perform pgque._require_batch(v_subs[v_i], v_curs[v_i], v_batch_ids[v_i]);
        end if;
    end loop;
    -- What _ack writes for one slot, for all of them in one statement (but
    -- the pieces of held events, acked one by one); each result goes where
    -- the slot was given.
    v_done := pgque._ack_cursors(array(select v_curs[t.i] from generate_subscripts(v_curs, 1) t(i)
                                        where t.i <> all(v_held) order by t.i));
    v_done := array(select case when t.i = any(v_held)
                                then pgque._ack_held(v_queue, v_group, v_subs[t.i], v_batch_ids[t.i],
                                                     null, null, interval '0')
                                else v_done[t.i - (select count(*) from unnest(v_held) h
                                                    where h < t.i)::integer] end
                      from generate_subscripts(v_curs, 1) t(i) order by t.i);
    select array_agg(v_done[t.i] order by v_positions[t.i]) into v_done
      from generate_subscripts(v_curs, 1) t(i);
    return v_done;
end
$$;

-- pgque.ack_receive_slots(queue, consumer, slots, ack_list, batch_ids,
-- receive_list, max_events): ack_slots of the pieces named (ack_list and
-- batch_ids at the same positions; empty lists: none), then receive_slots of
-- receive_list, in one transaction: what a session that serves many slots
-- does at each of its turns (the pieces its handlers finished, the slots it
-- wants more of) in one round trip and one commit. Errors as theirs; a
-- failure acks and receives nothing.
create or replace function pgque.ack_receive_slots(
    p_queue text, p_consumer text, p_slots integer, p_ack_list integer[],
    p_batch_ids bigint[], p_receive_list integer[], p_max_events integer default null)
returns table (slot integer, batch_id bigint, ev_id bigint, ev_time timestamptz,
               ev_retry integer, ev_type text, ev_data text, ev_extra1 text, epoch bigint,
               delayed_id bigint, ahead boolean)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    -- The receive locks of both lists first, ascending by slot (the lock order
    -- of every call that locks several slots of a group); the calls below take
    -- them again.
    perform 1 from (select distinct k from unnest(p_ack_list || p_receive_list) k) x
      join pgque.subscription s
        on s.sub_queue = v_queue.queue_id
       and s.sub_consumer = v_group.cg_consumer || '#' || x.k::text || '/'
                            || v_group.cg_slots::text
     order by x.k
       for no key update of s;
    if cardinality(p_ack_list) > 0 or cardinality(p_batch_ids) > 0 then
        perform pgque.ack_slots(p_queue, p_consumer, p_slots, p_ack_list, p_batch_ids);
    end if;
    return query select * from pgque.receive_slots(p_queue, p_consumer, p_slots,
                                                   p_receive_list, p_max_events);
end
$$;
