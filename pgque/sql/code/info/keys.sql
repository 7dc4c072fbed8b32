-- pgque: lag per key: which keys of a consumer group have the most events
-- waiting, and since when (issue 29's hot keys).

-- pgque.key_lag(queue, consumer, top): the top keys of group consumer by
-- pending events (those its slots have not consumed: not visible in the
-- snapshot of the slot's last finished tick, the slot's open batch
-- included, and its retries moved back into the log), each with its slot,
-- how many and the oldest one's ev_time; most pending first, then oldest
-- first. A null key is the events sent without one (slot 0). One read of the
-- queue's events from the lowest xmin of the slots' last ticks up, by the
-- ev_txid index: the pending window, not the log. PQ001, PQ002, PQ014,
-- PQ015 as for a receive; 22023 for a top below 1 or above 10,000.
create or replace function pgque.key_lag(p_queue text, p_consumer text, p_top integer default 10)
returns table (partition_key text, slot integer, pending bigint, oldest timestamptz)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_at record;
begin
    if p_top is null or p_top < 1 or p_top > 10000 then
        raise exception using errcode = '22023',
            message = format('key_lag: top must be from 1 to 10000, not %s', p_top);
    end if;
    v_group := pgque._group(v_queue, p_consumer, null);
    v_at := pgque._group_positions(v_queue, v_group);
    if v_at.slots is null then
        return;
    end if;
    return query execute format(
        'select e.ev_extra1, o.k, count(*), min(e.ev_time)'
        '  from pgque.%I e'
        '  join unnest($2, $3, $4) as o(k, sub, snap)'
        '    on o.k = %2$s'
        ' where e.ev_txid >= $1'
        '   and not pg_visible_in_snapshot(e.ev_txid, o.snap)'
        '   and (e.ev_owner is null or e.ev_owner = o.sub)'
        ' group by e.ev_extra1, o.k'
        ' order by count(*) desc, min(e.ev_time), e.ev_extra1 nulls first'
        ' limit $5',
        pgque._event_table(v_queue.queue_id), pgque._slot_expr(v_group.cg_slots))
    using v_at.floor, v_at.slots, v_at.subs, v_at.snaps, p_top;
end
$$;
