-- pgque: what operators look at (queues and consumers).

-- pgque._oldest_unconsumed(queue_id, sub_id, snapshot, slot, slots): ev_time
-- of the earliest-written event the subscription has not consumed yet (not
-- visible in the snapshot of its last finished tick; only the slot's events
-- when slots is given), or null. Reads the ev_txid index upward from the
-- snapshot's xmin and stops at the first such event.
create or replace function pgque._oldest_unconsumed(
    p_queue_id integer, p_sub_id integer, p_snapshot pg_snapshot,
    p_slot integer default null, p_slots integer default null)
returns timestamptz
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_time timestamptz;
begin
    execute format(
        'select e.ev_time from pgque.%I e'
        ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
        '   and (e.ev_owner is null or e.ev_owner = $3)'
        '   and ($5::integer is null'
        '        or (case when e.ev_extra1 is null then 0'
        '                 else (hashtextextended(e.ev_extra1, 0) %% $5 + $5) %% $5 end) = $4)'
        ' order by e.ev_txid limit 1',
        pgque._event_table(p_queue_id))
       into v_time
      using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
    return v_time;
end
$$;

-- pgque._queue_info: one row per queue with its settings, its newest tick and
-- how many events were sent since that tick.
create or replace view pgque._queue_info as
select q.queue_name,
       q.queue_id,
       q.queue_ntables as event_tables,
       q.queue_cur_table as current_table,
       q.queue_rotation_period as rotation_period,
       q.queue_switch_time as last_rotation,
       q.queue_ticker_max_count as ticker_max_count,
       q.queue_ticker_max_lag as ticker_max_lag,
       q.queue_ticker_idle_period as ticker_idle_period,
       q.queue_max_retries as max_retries,
       t.tick_id as last_tick_id,
       t.tick_time as last_tick_time,
       now() - t.tick_time as last_tick_age,
       coalesce(pg_sequence_last_value(q.queue_event_seq), 0) as event_seq,
       greatest(coalesce(pg_sequence_last_value(q.queue_event_seq), 0)
                - coalesce(t.tick_event_seq, 0), 0) as events_since_last_tick,
       (select count(*) from pgque.subscription s where s.sub_queue = q.queue_id) as consumers
  from pgque.queue q
  left join lateral (select * from pgque.tick t where t.tick_queue = q.queue_id
                      order by t.tick_id desc limit 1) t on true;

-- pgque._consumer_info: one row per subscription: where its cursor is, how far
-- behind it is (ticks, events by sequence position, time), its open batch and
-- the age of its oldest unconsumed event.
create or replace view pgque._consumer_info as
select q.queue_name,
       s.sub_consumer as consumer_name,
       s.sub_id,
       c.cur_last_tick as last_tick_id,
       t.tick_time as last_tick_time,
       now() - t.tick_time as lag,
       (select count(*) from pgque.tick n
         where n.tick_queue = q.queue_id and n.tick_id > c.cur_last_tick) as ticks_behind,
       greatest(coalesce(pg_sequence_last_value(q.queue_event_seq), 0)
                - coalesce(t.tick_event_seq, 0), 0) as pending_events,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       now() - pgque._oldest_unconsumed(q.queue_id, s.sub_id, t.tick_snapshot)
           as oldest_unconsumed_age,
       (select count(*) from pgque.retry_queue r where r.ev_owner = s.sub_id) as retries_waiting,
       (select count(*) from pgque.dead_letter d where d.dl_sub = s.sub_id) as dead_letters
  from pgque.subscription s
  join pgque.queue q on q.queue_id = s.sub_queue
  cross join lateral pgque._current_cursor(s.sub_id) c
  left join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick;

-- pgque._pending_events(queue_id, sub_id, snapshot, slot, slots): how many
-- committed events the subscription has not consumed yet (not visible in the
-- snapshot of its last finished tick), only the slot's when slots is given.
-- Counts at most one million, to bound the cost of looking.
create or replace function pgque._pending_events(
    p_queue_id integer, p_sub_id integer, p_snapshot pg_snapshot,
    p_slot integer default null, p_slots integer default null)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    execute format(
        'select count(*) from (select 1 from pgque.%I e'
        ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
        '   and (e.ev_owner is null or e.ev_owner = $3)'
        '   and ($5::integer is null'
        '        or (case when e.ev_extra1 is null then 0'
        '                 else (hashtextextended(e.ev_extra1, 0) %% $5 + $5) %% $5 end) = $4)'
        ' limit 1000000) pending',
        pgque._event_table(p_queue_id))
       into v_count
      using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
    return v_count;
end
$$;

-- pgque._partition_slot_status: one row per slot of every consumer group:
-- its owner (the backend holding the slot's advisory lock), how much it has
-- not consumed, its retries and dead letters, and whether it looks stalled
-- (events waiting for over a minute while nobody owns it or it has not moved
-- for a minute).
create or replace view pgque._partition_slot_status as
select q.queue_name,
       g.cg_consumer as consumer_name,
       k.slot,
       g.cg_slots as slots,
       l.pid as owner_pid,
       pgque._pending_events(q.queue_id, s.sub_id, t.tick_snapshot, k.slot, g.cg_slots)
           as pending_events,
       (select count(*) from pgque.tick n
         where n.tick_queue = q.queue_id and n.tick_id > c.cur_last_tick) as ticks_behind,
       o.age as oldest_unconsumed_age,
       now() - t.tick_time as lag,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       (select count(*) from pgque.retry_queue r where r.ev_owner = s.sub_id) as retries_waiting,
       (select count(*) from pgque.dead_letter d where d.dl_sub = s.sub_id) as dead_letters,
       coalesce(o.age > interval '1 minute'
                and (l.pid is null or now() - c.cur_time > interval '1 minute'),
                false) as stalled
  from pgque.consumer_group g
  join pgque.queue q on q.queue_id = g.cg_queue
  cross join lateral generate_series(0, g.cg_slots - 1) as k(slot)
  join pgque.subscription s
    on s.sub_queue = g.cg_queue and s.sub_consumer = pgque._slot_name(g.cg_consumer, k.slot, g.cg_slots)
  cross join lateral pgque._current_cursor(s.sub_id) c
  left join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick
  -- Read once: both the age column and the stalled flag need it.
  cross join lateral (select now() - pgque._oldest_unconsumed(q.queue_id, s.sub_id,
                                        t.tick_snapshot, k.slot, g.cg_slots) as age) o
  -- The owner: the session holding the slot's key exclusively, if its role
  -- may use the group (see 65_partition.sql).
  left join lateral (select k.pid from pgque._key_sessions(s.sub_lock_key) k
                      where k.granted and k.mode = 'ExclusiveLock'
                        and pgque._may_consume(k.role, q, g.cg_owner, g.cg_grantees)
                      limit 1) l on true;

-- The info views read event tables and sequences that callers have no
-- privileges on, so they are reached through SECURITY DEFINER functions,
-- which show a caller that is not an admin only what it may use: the queues
-- it may send to or consume from, the consumers it may use (see 15_access.sql).

-- pgque._caller_access(): the caller's role (its oid) and whether it is an
-- admin, worked out once per call, not once per row.
create or replace function pgque._caller_access(out role oid, out admin boolean)
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._role_id(c), pgque._is_admin(c) from pgque._caller() c $$;

-- pgque._may_see_queue(queue, role): whether a caller acting as role (an oid)
-- may see the queue: its grants of some kind let the role in.
create or replace function pgque._may_see_queue(p_queue pgque.queue, p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select p_queue.queue_consumers is null or p_queue.queue_senders is null
        or pgque._in_roles(p_role, p_queue.queue_consumers)
        or pgque._in_roles(p_role, p_queue.queue_senders)
$$;

-- pgque.get_queue_info(): the rows of pgque.queue_info.
create or replace function pgque.get_queue_info()
returns setof pgque._queue_info
language sql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select i.* from pgque._queue_info i
      join pgque.queue q on q.queue_id = i.queue_id
     cross join pgque._caller_access() me
     where me.admin or pgque._may_see_queue(q, me.role)
$$;

-- pgque.get_consumer_info(): the rows of pgque.consumer_info.
create or replace function pgque.get_consumer_info()
returns setof pgque._consumer_info
language sql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
    select i.* from pgque._consumer_info i
      join pgque.queue q on q.queue_name = i.queue_name
     cross join pgque._caller_access() me
     where me.admin or pgque._may_use_consumer_name(q, i.consumer_name, me.role)
$$;

-- pgque.queue_info / pgque.consumer_info: what operators query.
create or replace view pgque.queue_info as select * from pgque.get_queue_info();
create or replace view pgque.consumer_info as select * from pgque.get_consumer_info();

-- pgque.get_partition_slot_status(): the rows of pgque.partition_slot_status.
create or replace function pgque.get_partition_slot_status()
returns setof pgque._partition_slot_status
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
as $$
    select i.* from pgque._partition_slot_status i
      join pgque.queue q on q.queue_name = i.queue_name
     cross join pgque._caller_access() me
     -- consumer_name is the group's: '#' makes _may_use_consumer_name judge the group.
     where me.admin or pgque._may_use_consumer_name(q, i.consumer_name || '#', me.role)
$$;

create or replace view pgque.partition_slot_status as
select * from pgque.get_partition_slot_status();
