-- pgque: how evenly a consumer group's keys spread over its slots (issue
-- 29's skew report): whether N and the keys sent make every slot share the
-- work, or a few keys (or a few slots) take most of it.

-- pgque.slot_skew(queue, consumer, window): per slot of group consumer
-- (every slot, ascending, those without events too): the events sent to the
-- queue in the last window that route to it (pgque.slot_of over their keys),
-- the distinct keys among them (events without a key count as one key, of
-- slot 0), its share of the window's events and its load, events over the
-- mean per slot (1: an even share; the largest load is the max/mean ratio of
-- the group; null when the window has no events); and since, when the window
-- measured starts (the same on every row).
--
-- Events sent: the queue's events visible now (committed) whose transaction
-- started (ev_time) at or after the window's start, not counting retries
-- moved back into the log, which are delivered again, not sent.
--
-- Cost: one read of the window's events, by the ev_txid index, not of the
-- log: those of the transactions that the snapshot of the queue's newest
-- tick made at or before the window's start does not see (a tick's time is
-- taken after its snapshot, so a transaction that started later took its id
-- at or above the snapshot's xmax, or was running then, in its list), as a
-- batch is read. Measured once by hand (one core, 16 slots, 10,000 keys):
-- 1,000,000 events in the window took 0.11 s (0.31 s at the first read of
-- fresh rows, which sets their hint bits); 10,000 in the window of a queue
-- holding 1,000,000 more from before it, 5 ms. The window reaches no
-- further back than the queue's oldest tick, which maintenance keeps for a
-- minute or more (ticks rotate about once a minute, ticker/rotation.sql):
-- when that tick is younger than the window, the window starts there, as
-- since says.
--
-- Raises PQ001 (unknown queue), PQ002 (unknown group), PQ014 and PQ015 as
-- for a receive, and 22023 for a window that is null or not positive.
create or replace function pgque.slot_skew(p_queue text, p_consumer text,
                                           p_window interval default '1 minute')
returns table (slot integer, events bigint, keys bigint, share double precision,
               load double precision, since timestamptz)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
set lock_timeout = '100ms'  -- not behind a drop_queue or an install: 55P03 instead
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_start timestamptz;
    v_since timestamptz;
    v_floor xid8;
    v_running xid8[];
begin
    if p_window is null or p_window <= interval '0' then
        raise exception using errcode = '22023',
            message = format('slot_skew: window must be positive, not %s',
                             coalesce(p_window::text, 'null'));
    end if;
    v_group := pgque._group(v_queue, p_consumer, null);
    -- (No log is older than a thousand years: a longer window is that one,
    -- not a timestamp out of range.)
    v_start := now() - least(p_window, interval '1000 years');
    -- A tick's time is taken after its snapshot (log/tick.sql): a transaction
    -- that started after that time took its id at or above the snapshot's
    -- xmax, or before the snapshot, and then it was running (a tick's move of
    -- delayed events, whose ev_time is the tick's, in a ticker transaction
    -- that ticked another queue first).
    select t.tick_time, pg_snapshot_xmax(t.tick_snapshot),
           array(select pg_snapshot_xip(t.tick_snapshot))
      into v_since, v_floor, v_running
      from pgque.tick t
     where t.tick_queue = v_queue.queue_id and t.tick_time <= v_start
     order by t.tick_id desc limit 1;
    if found then
        v_since := v_start;
    else
        -- No tick is that old any more: the window starts at the oldest one.
        select t.tick_time, pg_snapshot_xmax(t.tick_snapshot),
               array(select pg_snapshot_xip(t.tick_snapshot))
          into v_since, v_floor, v_running
          from pgque.tick t
         where t.tick_queue = v_queue.queue_id
         order by t.tick_id limit 1;
    end if;
    return query execute format(
        'with counted as ('
        '    select %s as k, e.ev_extra1 as key, count(*) as n'
        '      from pgque.%I e'
        '     where (e.ev_txid >= $1 or e.ev_txid = any($4))'
        '       and e.ev_time >= $2 and e.ev_owner is null'
        '     group by 1, 2),'
        ' per_slot as ('
        '    select c.k, sum(c.n)::bigint as n, count(*) as keys from counted c group by c.k),'
        ' total as (select sum(p.n) as n from per_slot p)'
        ' select s.k, coalesce(p.n, 0), coalesce(p.keys, 0),'
        '        coalesce(p.n, 0)::float8 / nullif(t.n, 0)::float8,'
        '        coalesce(p.n, 0)::float8 * $3 / nullif(t.n, 0)::float8, $2'
        '   from generate_series(0, $3 - 1) s(k)'
        '   left join per_slot p on p.k = s.k'
        '  cross join total t'
        '  order by s.k',
        pgque._slot_expr(v_group.cg_slots), pgque._event_table(v_queue.queue_id))
    using v_floor, v_since, v_group.cg_slots, v_running;
end
$$;
