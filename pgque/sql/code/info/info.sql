-- pgque: what operators look at: queues, consumers, consumer groups and their
-- slots, the active ticker.
--
-- Stalls: a queue is stalled when events wait for a tick and nobody ticks it,
-- a slot when an event waits and nobody moves the slot, each judged against a
-- threshold (stalled_after) that the caller may give and that defaults to the
-- queue's own (_stalled_after).

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
set lock_timeout = '100ms'
as $$
declare
    v_time timestamptz;
begin
    begin
        execute format(
            'select e.ev_time from pgque.%I e'
            ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
            '   and (e.ev_owner is null or e.ev_owner = $3)%s'
            ' order by e.ev_txid limit 1',
            pgque._event_table(p_queue_id), pgque._slot_filter(p_slots, '$4'))
           into v_time
          using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
        return v_time;
    exception when undefined_table or lock_not_available then
        -- The queue was dropped after the caller's statement began, or is being
        -- dropped (see _sequence_value).
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return null;
exception when lock_not_available then
    return null;
end
$$;

-- pgque._sequence_value(seq): the last value of the queue's event sequence
-- seq (pg_sequence_last_value; 0 before its first use), or null when it
-- cannot be read: once drop_queue dropped it, or while one holds it. The info
-- views read queue rows that their statement's snapshot still shows, while
-- the sequence is looked up as it is now. Like the info views' other reads of
-- a queue's tables (_oldest_unconsumed, _pending_events, _queue_stalled), it
-- waits at most 100 ms for a lock: a view that holds the locks of the queues
-- it read so far and waits on one that drop_queue holds could close a cycle
-- with it, and would hang `pgque status` behind the drop; it answers null
-- (false) for that queue instead.
create or replace function pgque._sequence_value(p_seq regclass)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '100ms'
as $$
declare
    v_value bigint;
begin
    begin
        v_value := coalesce(pg_sequence_last_value(p_seq), 0);
        return v_value;  -- (a statement of its own: see pgque._seq_before)
    exception when undefined_table or internal_error or lock_not_available then
        -- "could not open relation with OID": the sequence is gone.
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return null;
exception when lock_not_available then
    return null;
end
$$;

-- pgque._stalled_after(queue): the queue's own stall threshold: twice its
-- ticker_idle_period, and at least 10 seconds. A running ticker ticks every
-- queue at least once per ticker_idle_period (events that wait, sooner), so
-- twice that is late; the floor keeps a short period from flagging a ticker's
-- hiccups (pg_cron's ticker_loop pauses about 2 seconds a minute).
create or replace function pgque._stalled_after(p_queue pgque.queue)
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select greatest(2 * p_queue.queue_ticker_idle_period, interval '10 seconds') $$;

-- pgque._check_stalled_after(after): 22023 for a negative threshold; null
-- (the queues' own) and zero (any wait) are fine.
create or replace function pgque._check_stalled_after(p_after interval)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_after < interval '0' then
        raise exception using errcode = '22023',
            message = format('stalled_after must not be negative, not %s', p_after);
    end if;
end
$$;

-- pgque._queue_stalled(queue_id, last_tick_id, last_tick_age, after): whether
-- nobody ticks the queue: its newest tick (last_tick_id) is older than after,
-- or there is none, and committed events wait for a tick: events that tick's
-- snapshot does not cover (_uncovered_events), or with no tick any event. Not
-- events_since_last_tick, which counts sequence positions: a send that rolled
-- back takes them but leaves no event, and an idle queue is never stalled.
-- Reads the event tables (an index probe on ev_txid each, as the ticker's
-- _tick_due does) only when the tick is old enough.
create or replace function pgque._queue_stalled(
    p_queue_id integer, p_tick_id bigint, p_tick_age interval, p_after interval)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '100ms'
as $$
declare
    v_snapshot pg_snapshot;
    v_found boolean;
begin
    begin
        if p_tick_age <= p_after then
            return false;
        end if;
        if p_tick_id is null then
            execute format('select exists (select 1 from pgque.%I)', pgque._event_table(p_queue_id))
               into v_found;
            return v_found;
        end if;
        select t.tick_snapshot into v_snapshot
          from pgque.tick t
         where t.tick_queue = p_queue_id and t.tick_id = p_tick_id;
        v_found := coalesce(pgque._uncovered_events(p_queue_id, v_snapshot), false);
        return v_found;  -- (a statement of its own: see pgque._seq_before)
    exception when undefined_table or lock_not_available then
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return false;  -- the queue is being dropped, or was (see _sequence_value)
exception when lock_not_available then
    return false;
end
$$;

-- pgque._slot_stalled(oldest_unconsumed_age, owned, last_active, after):
-- whether a slot looks stalled: an event has waited longer than after, and
-- nobody owns the slot or it has not moved (no receive or ack) for that long.
-- False when nothing waits.
create or replace function pgque._slot_stalled(
    p_oldest interval, p_owned boolean, p_last_active timestamptz, p_after interval)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(p_oldest > p_after
                    and (not p_owned or now() - p_last_active > p_after), false)
$$;

-- pgque._queue_info: one row per queue with its settings, its newest tick,
-- how many events were sent since that tick (by sequence position: sends
-- that rolled back count too), its subscriptions (all of them: get_queue_info
-- counts a non-admin's only), whether it is stalled by its own threshold
-- (_queue_stalled, which looks for committed events instead), its delayed
-- events not in the log yet (how many, the next due) and the idempotency keys
-- it remembers (those two count rows: status, not a hot path).
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
       e.event_seq,
       e.events_since_last_tick,
       (select count(*) from pgque.subscription s where s.sub_queue = q.queue_id) as consumers,
       pgque._stalled_after(q) as stalled_after,
       pgque._queue_stalled(q.queue_id, t.tick_id, now() - t.tick_time,
                            pgque._stalled_after(q)) as stalled,
       d.waiting as delayed_events,
       d.next_due as next_delivery,
       q.queue_idempotency_window as idempotency_window,
       pgque._idempotency_keys(q) as idempotency_keys
  from pgque.queue q
  cross join lateral pgque._delayed_waiting(q.queue_id) d
  left join lateral (select * from pgque.tick t where t.tick_queue = q.queue_id
                      order by t.tick_id desc limit 1) t on true
  cross join lateral (
      select coalesce(pgque._sequence_value(q.queue_event_seq), 0) as event_seq,
             greatest(coalesce(pgque._sequence_value(q.queue_event_seq), 0)
                      - coalesce(t.tick_event_seq, 0), 0) as events_since_last_tick) e;

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
       greatest(coalesce(pgque._sequence_value(q.queue_event_seq), 0)
                - coalesce(t.tick_event_seq, 0), 0) as pending_events,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       now() - pgque._oldest_unconsumed(q.queue_id, s.sub_id, t.tick_snapshot)
           as oldest_unconsumed_age,
       (select count(*) from pgque._retry_waiting r where r.ev_owner = s.sub_id) as retries_waiting,
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
set lock_timeout = '100ms'
as $$
declare
    v_count bigint;
begin
    begin
        execute format(
            'select count(*) from (select 1 from pgque.%I e'
            ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
            '   and (e.ev_owner is null or e.ev_owner = $3)%s'
            ' limit 1000000) pending',
            pgque._event_table(p_queue_id), pgque._slot_filter(p_slots, '$4'))
           into v_count
          using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
        return v_count;
    exception when undefined_table or lock_not_available then
        -- The queue was dropped after the caller's statement began, or is being
        -- dropped (see _sequence_value).
        null;  -- (a lock timeout left pending is raised here: see pgque._seq_before)
    end;
    return null;
exception when lock_not_available then
    return null;
end
$$;

-- pgque._partition_slot_status: one row per slot of every consumer group:
-- its owner (the backend holding the slot's advisory lock, and the
-- application name that session set: pg_stat_activity shows it to every
-- role, unlike the backend's start or its query; in a group that owns by
-- lease, no backend but the live lease named by the slot's claim, owner_lease,
-- and the name its holder gave it), the slot's current epoch
-- (slots/fence.sql), how much it has not consumed, its retries and dead letters,
-- and whether it looks stalled by the queue's own threshold (_slot_stalled).
create or replace view pgque._partition_slot_status as
select q.queue_name,
       g.cg_consumer as consumer_name,
       k.slot,
       g.cg_slots as slots,
       l.pid as owner_pid,
       coalesce(l.name, ls.lease_name) as owner_name,
       e.sc_epoch as epoch,
       pgque._pending_events(q.queue_id, s.sub_id, t.tick_snapshot, k.slot, g.cg_slots)
           as pending_events,
       (select count(*) from pgque.tick n
         where n.tick_queue = q.queue_id and n.tick_id > c.cur_last_tick) as ticks_behind,
       o.age as oldest_unconsumed_age,
       now() - t.tick_time as lag,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       (select count(*) from pgque._retry_waiting r where r.ev_owner = s.sub_id) as retries_waiting,
       (select count(*) from pgque.dead_letter d where d.dl_sub = s.sub_id) as dead_letters,
       pgque._stalled_after(q) as stalled_after,
       pgque._slot_stalled(o.age, l.pid is not null or ls.lease_id is not null, c.cur_time,
                           pgque._stalled_after(q)) as stalled,
       b.blocked_keys,
       b.oldest_blocked_age,
       ls.lease_id as owner_lease
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
  -- may use the group (see slots/groups.sql); null for a name it did not set.
  left join lateral (select k.pid, nullif(a.application_name, '') as name
                       from pgque._key_sessions(s.sub_lock_key) k
                       left join pg_stat_activity a on a.pid = k.pid
                      where k.granted and k.mode = 'ExclusiveLock'
                        and pgque._may_consume(k.role, q, g.cg_owner, g.cg_grantees)
                      limit 1) l on true
  left join pgque.slot_claim e on e.sc_sub = s.sub_id
  -- By lease: the live lease the claim names, if its role may use the group.
  left join lateral (select x.lease_id, x.lease_name from pgque.lease x
                      where g.cg_lease is not null and x.lease_id = e.sc_lease
                        and x.lease_until > clock_timestamp()
                        and pgque._may_consume(x.lease_role, q, g.cg_owner, g.cg_grantees)) ls
    on true
  -- The pause policy's blocked keys (slots/pause.sql) and how long the oldest
  -- has waited for its head.
  cross join lateral (select count(*) as blocked_keys,
                             now() - min(x.bk_since) as oldest_blocked_age
                        from pgque.blocked_key x where x.bk_sub = s.sub_id) b;

-- pgque._group_info: one row per consumer group: its slot count, its live
-- members (sessions holding one of its member keys, see join_group), how many
-- slots have an owner and the newest epoch of its slots. Only sessions whose
-- roles may use the group count, as in group_status. pg_locks is read once.
create or replace view pgque._group_info as
with locks as materialized (
    -- Advisory locks are per database, but pg_locks shows the whole cluster.
    select l.classid, l.objid, l.objsubid, l.pid, a.usesysid as role
      from pg_locks l
      left join pg_stat_activity a on a.pid = l.pid
     where l.locktype = 'advisory' and l.granted and l.mode = 'ExclusiveLock'
       and l.database = (select oid from pg_database where datname = current_database()))
select q.queue_name,
       g.cg_consumer as consumer_name,
       g.cg_slots as slots,
       ((select count(distinct k.pid) from locks k
          where k.objsubid = 2 and k.classid = pgque._member_class(g)::oid
            and pgque._may_consume(k.role, q, g.cg_owner, g.cg_grantees))
        -- By lease: the live member leases (slots/lease.sql).
        + (select count(*) from pgque.lease x
            where x.lease_group = g.cg_id and x.lease_member
              and x.lease_until > clock_timestamp()
              and pgque._may_consume(x.lease_role, q, g.cg_owner, g.cg_grantees)))::integer
           as members,
       (select count(*)
          from pgque.subscription s
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))
           and (exists (select 1 from locks k
                         where k.objsubid = 1
                           and k.classid = ((s.sub_lock_key >> 32) & 4294967295)::oid
                           and k.objid = (s.sub_lock_key & 4294967295)::oid
                           and pgque._may_consume(k.role, q, g.cg_owner, g.cg_grantees))
                or exists (select 1 from pgque.slot_claim e
                             join pgque.lease x on x.lease_id = e.sc_lease
                            where e.sc_sub = s.sub_id and x.lease_until > clock_timestamp()
                              and pgque._may_consume(x.lease_role, q, g.cg_owner,
                                                     g.cg_grantees)))
       )::integer as owned_slots,
       (select max(c.sc_epoch)
          from pgque.subscription s
          join pgque.slot_claim c on c.sc_sub = s.sub_id
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))) as newest_epoch,
       g.cg_policy as failure_policy,
       g.cg_max_attempts as max_attempts,
       g.cg_pause_timeout as pause_timeout,
       g.cg_max_retries as max_retries,
       (select count(*)
          from pgque.subscription s
          join pgque.blocked_key b on b.bk_sub = s.sub_id
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))) as blocked_keys,
       (select count(*)
          from pgque.subscription s
          join pgque.dead_letter d on d.dl_sub = s.sub_id
         where s.sub_queue = q.queue_id
           and s.sub_consumer = any (array(
                   select pgque._slot_name(g.cg_consumer, n, g.cg_slots)
                     from generate_series(0, g.cg_slots - 1) n))) as dead_letters
  from pgque.consumer_group g
  join pgque.queue q on q.queue_id = g.cg_queue;

-- The info views read event tables and sequences that callers have no
-- privileges on, so they are reached through SECURITY DEFINER functions,
-- which show a caller that is not an admin only what it may use: the queues
-- it may send to or consume from, the consumers it may use (see base/access.sql).

-- pgque._caller_access(): the caller's role (its oid) and whether it is an
-- admin, worked out once per call, not once per row.
create or replace function pgque._caller_access(out role oid, out admin boolean)
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._role_id(c), pgque._is_admin(c) from pgque._caller() c $$;

-- pgque._may_send_at_all(role) / pgque._may_consume_at_all(role): whether role
-- (an oid), or a role it is a member of, may run a send (pgque_writer, or a
-- role granted EXECUTE on one) / a receive (pgque_reader, or likewise): the
-- role-wide bound that a queue's grants only narrow.
create or replace function pgque._may_send_at_all(p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._may_execute(p_role, to_regprocedure('pgque.send(text,text,jsonb,text)'))
        or pgque._may_execute(p_role, to_regprocedure('pgque.send(text,text,text,text)'))
        or pgque._may_execute(p_role, to_regprocedure('pgque.send_batch(text,text[],text[],text[])'))
$$;

create or replace function pgque._may_consume_at_all(p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._may_execute(p_role, to_regprocedure('pgque.receive(text,text,integer)'))
        or pgque._may_execute(
               p_role, to_regprocedure('pgque.receive_partitioned(text,text,integer,integer,integer)'))
$$;

-- pgque._may_see_queue(queue, role, sends, consumes): whether a caller acting
-- as role (an oid) that is not an admin may see the queue: it may send to it
-- (sends: it may send at all, _may_send_at_all, and the queue's 'send' grants
-- let it in) or consume from it (consumes, _may_consume_at_all, and the
-- 'consume' grants). A queue without grants of a kind lets in every role that
-- may do that at all, and no other: a reader does not see a queue whose
-- 'consume' grants leave it out because anyone may send there.
create or replace function pgque._may_see_queue(
    p_queue pgque.queue, p_role oid, p_sends boolean, p_consumes boolean)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select (p_sends and (p_queue.queue_senders is null
                         or pgque._in_roles(p_role, p_queue.queue_senders)))
        or (p_consumes and (p_queue.queue_consumers is null
                            or pgque._in_roles(p_role, p_queue.queue_consumers)))
$$;

-- pgque.get_queue_info(stalled_after): the rows of pgque.queue_info, with
-- stalled judged against stalled_after when given (else each queue's own,
-- _stalled_after; 22023 when negative). A caller that is not an admin sees
-- the queues it may send to or consume from, and their consumers counts only
-- the subscriptions it may use (those consumer_info shows it).
create or replace function pgque.get_queue_info(p_stalled_after interval default null)
returns setof pgque._queue_info
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_me record;
    v_sends boolean := false;
    v_consumes boolean := false;
    r pgque._queue_info;
begin
    perform pgque._check_stalled_after(p_stalled_after);
    select * into v_me from pgque._caller_access();
    if not v_me.admin then
        v_sends := pgque._may_send_at_all(v_me.role);
        v_consumes := pgque._may_consume_at_all(v_me.role);
    end if;
    for r in select i.* from pgque._queue_info i
               join pgque.queue q on q.queue_id = i.queue_id
              where v_me.admin or pgque._may_see_queue(q, v_me.role, v_sends, v_consumes) loop
        if not v_me.admin then
            r.consumers := (select count(*) from pgque.subscription s
                              join pgque.queue q on q.queue_id = s.sub_queue
                             where s.sub_queue = r.queue_id
                               and pgque._may_use_consumer_name(q, s.sub_consumer, v_me.role));
        end if;
        if p_stalled_after is not null then
            r.stalled_after := p_stalled_after;
            r.stalled := pgque._queue_stalled(r.queue_id, r.last_tick_id, r.last_tick_age,
                                              p_stalled_after);
        end if;
        return next r;
    end loop;
end
$$;

-- pgque.get_consumer_info(): the rows of pgque.consumer_info.
create or replace function pgque.get_consumer_info()
returns setof pgque._consumer_info
language sql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select i.* from pgque._consumer_info i
      join pgque.queue q on q.queue_name = i.queue_name
     cross join pgque._caller_access() me
     where me.admin or pgque._may_use_consumer_name(q, i.consumer_name, me.role)
$$;

-- pgque.queue_info / pgque.consumer_info: what operators query.
create or replace view pgque.queue_info as select * from pgque.get_queue_info();
create or replace view pgque.consumer_info as select * from pgque.get_consumer_info();

-- pgque.get_partition_slot_status(stalled_after): the rows of
-- pgque.partition_slot_status (of the groups the caller may use, for one
-- that is not an admin), with stalled judged against stalled_after when given
-- (else each queue's own, _stalled_after; 22023 when negative).
create or replace function pgque.get_partition_slot_status(p_stalled_after interval default null)
returns setof pgque._partition_slot_status
language plpgsql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    r pgque._partition_slot_status;
begin
    perform pgque._check_stalled_after(p_stalled_after);
    for r in select i.* from pgque._partition_slot_status i
               join pgque.queue q on q.queue_name = i.queue_name
              cross join pgque._caller_access() me
              -- consumer_name is the group's: '#' makes _may_use_consumer_name judge the group.
              where me.admin or pgque._may_use_consumer_name(q, i.consumer_name || '#', me.role)
    loop
        if p_stalled_after is not null then
            r.stalled_after := p_stalled_after;
            r.stalled := pgque._slot_stalled(r.oldest_unconsumed_age,
                                             r.owner_pid is not null
                                             or r.owner_lease is not null,
                                             r.last_active, p_stalled_after);
        end if;
        return next r;
    end loop;
end
$$;

create or replace view pgque.partition_slot_status as
select * from pgque.get_partition_slot_status();

-- pgque.get_group_info(): the rows of pgque.group_info: the consumer groups
-- the caller may use (all of them for an admin).
create or replace function pgque.get_group_info()
returns setof pgque._group_info
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select pg_stat_clear_snapshot();  -- sessions that started since the transaction did
    select i.* from pgque._group_info i
      join pgque.queue q on q.queue_name = i.queue_name
     cross join pgque._caller_access() me
     where me.admin or pgque._may_use_consumer_name(q, i.consumer_name || '#', me.role)
$$;

create or replace view pgque.group_info as select * from pgque.get_group_info();

-- pgque.get_ticker_info(): the row of pgque.ticker_info: the database's
-- active ticker (active_ticker(): only sessions that may tick count), by
-- backend pid and the application name its session set; nulls when none is
-- active. Who ticks is no secret (pg_stat_activity shows every session), so
-- every reader may see it: when nothing ticks, nothing is delivered.
create or replace function pgque.get_ticker_info(out active_pid integer, out active_name text)
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select t.pid, nullif(a.application_name, '')
      from (select pgque.active_ticker() as pid) t
      left join pg_stat_activity a on a.pid = t.pid
$$;

create or replace view pgque.ticker_info as select * from pgque.get_ticker_info();

-- pgque.get_generated_code(): the rows of pgque.generated_code: every piece
-- of generated code (code/generated/generator.sql) with whether it is current
-- (false: it lags, and what it serves runs the slower dynamic way until
-- maintenance writes it). A caller that is not an admin sees the event writer
-- and the code of the queues it may see (those queue_info shows it).
create or replace function pgque.get_generated_code(
    out kind text, out queue_name text, out name text, out current boolean)
returns setof record
language sql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    -- Who the caller is and what it may do at all, judged once, not per row.
    with me as materialized (
        select c.admin, c.role, pgque._may_send_at_all(c.role) as sends,
               pgque._may_consume_at_all(c.role) as consumes
          from pgque._caller_access() c)
    select g.kind, q.queue_name, g.name, g.current
      from pgque._generated_code() g
      left join pgque.queue q on q.queue_id = g.queue_id
     cross join me
     where g.queue_id is null or me.admin
        or pgque._may_see_queue(q, me.role, me.sends, me.consumes)
     order by g.queue_id nulls first, g.kind
$$;

create or replace view pgque.generated_code as select * from pgque.get_generated_code();
