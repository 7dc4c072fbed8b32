-- pgque: metrics for a monitoring system (issue 29): every figure of the
-- queues, plain consumers, consumer groups and slots the caller may see, in
-- one call, as rows that `pgque exporter` (pgque/exporter.py) serves in
-- Prometheus' text format.
--
-- pgque.metrics() returns (metric, labels, value): the metric's Prometheus
-- name, its labels as Prometheus writes them (name="value" pairs joined by
-- commas, values escaped: queue="orders",group="charge",slot="3"; empty for
-- none; every row of a metric has the same names in the same order) and the
-- value, so that a sample's line is metric{labels} value. (An array of names
-- and values took twice as long for the exporter to fetch: 1,600 slots make
-- some 16,000 rows.) A figure that does not exist (a slot that never had an
-- epoch, a queue without ticks) has no row. The metrics, by their labels:
--
--   no labels
--     pgque_active_ticker               1 when a ticker holds the election
--                                       (active_ticker()), else 0
--     pgque_newest_tick_age_seconds     age of the newest tick of any queue
--                                       shown (a running ticker keeps it
--                                       below the longest ticker_idle_period)
--   pid, name
--     pgque_active_ticker_info          1: the active ticker's backend pid and
--                                       the application name its session set
--                                       (its pid when it set none)
--   queue
--     pgque_queue_events_total          positions taken from the queue's event
--                                       sequence: every event sent, a send
--                                       that rolled back too, a delayed event
--                                       when sent and again when it enters the
--                                       log, one more per maintenance pass
--                                       that moved retries back (a counter:
--                                       rate() is events/s; 0 before the
--                                       first send)
--     pgque_queue_events_since_last_tick  of those, the positions taken since
--                                       the newest tick (not ticked yet)
--     pgque_queue_last_tick_age_seconds  age of the queue's newest tick
--     pgque_queue_stalled               1 when committed events wait for a tick
--                                       that nobody makes (queue_info.stalled)
--     pgque_queue_stalled_after_seconds  the queue's stall threshold
--     pgque_queue_current_table         the event table written now (0 to
--                                       event_tables - 1)
--     pgque_queue_rotation_age_seconds  time since the queue last switched
--                                       tables (queue_info.last_rotation)
--     pgque_queue_rotation_period_seconds  the queue's rotation_period
--   queue, table
--     pgque_queue_table_size_bytes      estimated size of event table n:
--                                       pg_class.relpages as its last vacuum,
--                                       analyze or truncate left it (read from
--                                       the catalog, so no lock is taken: a
--                                       size function would lock the table)
--   queue, consumer (plain consumers), and queue, group, slot (the slots of
--   consumer groups), as pgque_consumer_<name> and pgque_slot_<name>:
--     _behind_events                    positions of the queue's event
--                                       sequence after the subscription's
--                                       last finished tick: the events of
--                                       every key sent since (not only the
--                                       slot's: that needs a read of the
--                                       events, pgque.key_lag), its open batch
--                                       included, rolled-back sends too
--     _lag_seconds                      age of the first tick after the last
--                                       finished one: every event it covers
--                                       has waited at least this long; 0 when
--                                       the subscription is at the newest tick
--     _ticks_behind                     ticks of the queue after the last
--                                       finished one, counted up to 100 (a
--                                       subscription further behind shows 100:
--                                       its lag and backlog say how far)
--     _last_active_age_seconds          time since its last receive or ack
--     _retries_waiting                  its nacked events not back in the log
--     _dead_letters                     its dead letters
--     _stalled                          1 when its lag exceeds the queue's
--                                       threshold and it has not moved for as
--                                       long, or (a slot) nobody owns it:
--                                       unlike pgque status, also when the
--                                       ticks waiting hold no event of the
--                                       slot's keys, since an unread slot holds
--                                       back rotation all the same
--   queue, group, slot (slots only)
--     pgque_slot_owned                  1 when a session the group counts holds
--                                       the slot's lock, else 0
--     pgque_slot_epoch                  the slot's current fencing epoch (no
--                                       row before its first receive)
--     pgque_slot_blocked_keys           keys the pause policy blocks
--     pgque_slot_oldest_blocked_age_seconds  how long the oldest blocked key
--                                       has waited (no row when none)
--   queue, group, slot, owner, pid
--     pgque_slot_owner_info             1 per owned slot: the owner's
--                                       application name (its pid when it set
--                                       none) and backend pid; by lease, the
--                                       lease's name and an empty pid
--   queue, group
--     pgque_group_slots                 the group's slot count
--     pgque_group_members               its live members (join_group; by
--                                       lease, the live member leases)
--
-- Cost. The info views count each slot's pending events in the event tables
-- (about 0.6 ms a slot), too slow to scrape a hundred queues of sixteen slots
-- every few seconds. metrics() reads no event table (but for _queue_stalled's
-- index probe of a queue whose newest tick is older than its threshold): a
-- subscription's figures come from its newest cursor row, the ticks and the
-- queue's sequence. The ticks are read at most 100 a queue for ticks_behind
-- and looked up once per distinct position (the slots of an idle group share
-- one), pg_locks and pg_stat_activity once, the retries and blocked keys in
-- one aggregate each, the dead letters by index (a count: proportional to the
-- dead letters kept). At 100 queues of 16 slots under load a call took 32 ms
-- (median) with the fetch of its 15,800 rows: docs/benchmarks.md, suite
-- exporter.
--
-- Access, as the info views: a caller that is not an admin sees the queues it
-- may send to or consume from, and the consumers and groups of those it may
-- use; only sessions whose role may use a group count as its owners and
-- members. Locks: it reads, locking nothing that a producer or a worker waits
-- for (no row locks; size functions are not called), and waits at most
-- 100 ms for a lock (a rotation's truncate, a drop_queue, an install hold
-- theirs until they commit), then fails with 55P03 rather than hang a scrape;
-- a queue's sequence and stall probe, held by a drop_queue, answer 0 instead.

-- pgque._label(name, value): one label as the text format writes it,
-- name="value", with backslashes, double quotes and newlines in value
-- escaped (names of queues and consumers have none, application names may
-- have the first two); a null value as empty. E'' strings: the same whatever
-- standard_conforming_strings says.
create or replace function pgque._label(p_name text, p_value text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select p_name || '="'
           || replace(replace(replace(coalesce(p_value, ''), E'\\', E'\\\\'),
                              '"', E'\\"'),
                      E'\n', E'\\n')
           || '"'
$$;

-- pgque.metrics(): the rows described above.
create or replace function pgque.metrics()
returns table (metric text, labels text, value double precision)
language plpgsql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
set lock_timeout = '100ms'
as $$
#variable_conflict use_column
declare
    v_me record;
    v_sends boolean := false;
    v_consumes boolean := false;
    v_parts record;
    v_ticker integer;
    v_ticker_name text;
begin
    perform pg_stat_clear_snapshot();  -- sessions that started since the transaction did
    select * into v_me from pgque._caller_access();
    if not v_me.admin then
        v_sends := pgque._may_send_at_all(v_me.role);
        v_consumes := pgque._may_consume_at_all(v_me.role);
    end if;
    v_parts := pgque._cursor_parts();
    v_ticker := pgque.active_ticker();
    v_ticker_name := (select coalesce(nullif(a.application_name, ''), v_ticker::text)
                        from pg_stat_activity a where a.pid = v_ticker);
    return query
    with queues as materialized (
        -- The queues the caller may see, with their newest tick and sequence.
        select q as qrow, q.queue_id, pgque._label('queue', q.queue_name) as queue_label,
               q.queue_ntables, q.queue_cur_table,
               q.queue_switch_time, q.queue_rotation_period,
               pgque._stalled_after(q) as stalled_after,
               t.tick_id, t.tick_time, t.tick_event_seq,
               -- null, and no row of the queue's that needs it, when it cannot be
               -- read (a drop_queue holds it): a counter that read 0 would look
               -- reset to Prometheus, and rate() would count the whole sequence.
               pgque._sequence_value(q.queue_event_seq) as seq
          from pgque.queue q
          left join lateral (select t.tick_id, t.tick_time, t.tick_event_seq
                               from pgque.tick t where t.tick_queue = q.queue_id
                              order by t.tick_id desc limit 1) t on true
         where v_me.admin or pgque._may_see_queue(q, v_me.role, v_sends, v_consumes)),
    groups as materialized (
        -- Access is judged once per group, not per slot.
        select q.qrow, q.queue_id, q.seq, q.stalled_after,
               q.queue_label || ',' || pgque._label('group', g.cg_consumer) as group_label,
               g.cg_id, g.cg_consumer, g.cg_slots, g.cg_owner, g.cg_grantees,
               pgque._member_class(g)::oid as member_class
          from queues q
          join pgque.consumer_group g on g.cg_queue = q.queue_id
         where v_me.admin or pgque._may_consume(v_me.role, q.qrow, g.cg_owner, g.cg_grantees)),
    subs as materialized (
        -- The slots of those groups, then the plain consumers the caller may use.
        select g.qrow, g.queue_id, g.seq, g.stalled_after,
               g.group_label || ',slot="' || k.slot::text || '"' as labels,
               k.slot, s.sub_id, s.sub_lock_key, g.cg_owner as owner, g.cg_grantees as grantees
          from groups g
         cross join lateral generate_series(0, g.cg_slots - 1) k(slot)
          -- _slot_name, written out (as in _group_subs)
          join pgque.subscription s
            on s.sub_queue = g.queue_id
           and s.sub_consumer = g.cg_consumer || '#' || k.slot::text || '/' || g.cg_slots::text
        union all
        select q.qrow, q.queue_id, q.seq, q.stalled_after,
               q.queue_label || ',' || pgque._label('consumer', s.sub_consumer),
               null, s.sub_id, null, s.sub_owner, s.sub_grantees
          from queues q
          join pgque.subscription s on s.sub_queue = q.queue_id
         where position('#' in s.sub_consumer) = 0
           and (v_me.admin or pgque._may_consume(v_me.role, q.qrow, s.sub_owner, s.sub_grantees))),
    cursors as materialized (
        -- pgque._current_cursor, written out (as in _slot_subs): a call per
        -- subscription cost more than its read. No row when a rotation
        -- emptied its partition after this statement's snapshot.
        select s.*, coalesce(c1.cur_last_tick, c2.cur_last_tick) as last_tick,
               coalesce(c1.cur_time, c2.cur_time) as last_active
          from subs s
          left join lateral (select o.cur_last_tick, o.cur_time from pgque.cursor o
                              where o.cur_part = v_parts.part and o.cur_sub = s.sub_id
                              order by o.cur_seq desc limit 1) c1 on true
          left join lateral (select o.cur_last_tick, o.cur_time from pgque.cursor o
                              where c1.cur_last_tick is null and o.cur_part = v_parts.moved_from
                                and o.cur_sub = s.sub_id
                              order by o.cur_seq desc limit 1) c2 on true),
    heads as materialized (
        -- Per queue, its newest ticks after its oldest position, at most 100,
        -- as an ascending array of their ids negated (read backwards along the
        -- index, so no sort): a position's ticks_behind is how many lie above
        -- it, which width_bucket finds by a binary search. So counting reads
        -- at most 100 ticks a queue, however many positions it has. (Ticks of
        -- a hundred queues lie on as many pages, and the pages written lately
        -- are not all-visible yet: each one read costs a heap fetch. Up to
        -- 1000 a queue, 98 queues far behind took 50 ms before a vacuum.)
        select p.queue_id,
               array(select -n.tick_id from pgque.tick n
                      where n.tick_queue = p.queue_id and n.tick_id > p.oldest
                      order by n.tick_id desc limit 100) as ids
          from (select c.queue_id, min(c.last_tick) as oldest from cursors c
                 group by c.queue_id) p),
    positions as materialized (
        -- Each distinct position once, by index: the sequence at its tick and
        -- the time of the first tick after it.
        select p.queue_id, p.last_tick,
               (select t.tick_event_seq from pgque.tick t
                 where t.tick_queue = p.queue_id and t.tick_id = p.last_tick) as seq_at,
               width_bucket(-p.last_tick - 1, h.ids) as ticks_behind,  -- -id < -last_tick
               (select n.tick_time from pgque.tick n
                 where n.tick_queue = p.queue_id and n.tick_id > p.last_tick
                 order by n.tick_id limit 1) as next_tick_time
          from (select distinct c.queue_id, c.last_tick from cursors c
                 where c.last_tick is not null) p
          join heads h on h.queue_id = p.queue_id),
    locks as materialized (
        -- Advisory locks are per database, but pg_locks shows the whole cluster.
        select l.classid, l.objid, l.objsubid, l.pid, a.usesysid as role,
               coalesce(nullif(a.application_name, ''), l.pid::text) as name
          from pg_locks l
          left join pg_stat_activity a on a.pid = l.pid
         where l.locktype = 'advisory' and l.granted and l.mode = 'ExclusiveLock'
           and l.database = (select d.oid from pg_database d where d.datname = current_database())),
    owners as materialized (
        -- The session holding a slot's key, if its role may use the group; by
        -- lease (slots/lease.sql), the live lease the slot's claim names, by
        -- its name (no pid).
        select distinct on (o.sub_id) o.sub_id, o.label
          from (select s.sub_id, k.pid,
                       pgque._label('owner', k.name) || ',pid="' || k.pid::text || '"' as label
                  from subs s
                  join locks k
                    on k.objsubid = 1
                   and k.classid = ((s.sub_lock_key >> 32) & 4294967295)::oid
                   and k.objid = (s.sub_lock_key & 4294967295)::oid
                 where pgque._may_consume(k.role, s.qrow, s.owner, s.grantees)
                union all
                select s.sub_id, null, pgque._label('owner', x.lease_name) || ',pid=""'
                  from subs s
                  join pgque.slot_claim e on s.slot is not null and e.sc_sub = s.sub_id
                  join pgque.lease x on x.lease_id = e.sc_lease
                 where x.lease_until > clock_timestamp()
                   and pgque._may_consume(x.lease_role, s.qrow, s.owner, s.grantees)) o
         order by o.sub_id, o.pid),
    members as materialized (
        select m.cg_id, count(*) as n
          from (select distinct g.cg_id, k.pid::bigint as member
                  from groups g
                  join locks k on k.objsubid = 2 and k.classid = g.member_class
                 where pgque._may_consume(k.role, g.qrow, g.cg_owner, g.cg_grantees)
                union all
                select g.cg_id, -x.lease_id
                  from groups g
                  join pgque.lease x on x.lease_group = g.cg_id and x.lease_member
                 where x.lease_until > clock_timestamp()
                   and pgque._may_consume(x.lease_role, g.qrow, g.cg_owner, g.cg_grantees)) m
         group by m.cg_id),
    retries as materialized (
        select r.ev_owner as sub_id, count(*) as n from pgque._retry_waiting r group by r.ev_owner),
    blocked as materialized (
        select b.bk_sub as sub_id, count(*) as n, min(b.bk_since) as since
          from pgque.blocked_key b group by b.bk_sub),
    figures as (
        -- One row per subscription with all its figures.
        select c.labels, c.slot,
               case when c.slot is null then 'pgque_consumer_' else 'pgque_slot_' end as prefix,
               -- In double precision from here on (date_part, not extract):
               -- numeric arithmetic on every value cost a tenth of the call.
               (c.seq - least(p.seq_at, c.seq))::float8 as behind,  -- (null with seq)
               case when c.last_tick is not null
                    then coalesce(date_part('epoch', now() - p.next_tick_time), 0) end as lag,
               p.ticks_behind::float8 as ticks_behind,
               date_part('epoch', now() - c.last_active) as idle,
               coalesce(r.n, 0)::float8 as retries,
               (select count(*) from pgque.dead_letter d where d.dl_sub = c.sub_id)::float8
                   as dead,
               o.sub_id is not null as owned, o.label as owner_label,
               e.sc_epoch::float8 as epoch,
               coalesce(b.n, 0)::float8 as blocked,
               date_part('epoch', now() - b.since) as blocked_age,
               coalesce(now() - p.next_tick_time > c.stalled_after
                        and ((c.slot is not null and o.sub_id is null)
                             or now() - c.last_active > c.stalled_after), false) as stalled
          from cursors c
          left join positions p on p.queue_id = c.queue_id and p.last_tick = c.last_tick
          left join owners o on o.sub_id = c.sub_id
          left join retries r on r.sub_id = c.sub_id
          left join blocked b on b.sub_id = c.sub_id
          left join pgque.slot_claim e on c.slot is not null and e.sc_sub = c.sub_id)
    -- The ticker.
    select 'pgque_active_ticker', '', (v_ticker is not null)::integer::float8
    union all
    select 'pgque_active_ticker_info',
           'pid="' || v_ticker::text || '",' || pgque._label('name', v_ticker_name), 1
     where v_ticker is not null
    union all
    select 'pgque_newest_tick_age_seconds', '',
           date_part('epoch', now() - max(q.tick_time))
      from queues q
    having max(q.tick_time) is not null
    union all
    -- The queues.
    select m.metric, q.queue_label, m.value
      from queues q
     cross join lateral (values
         ('pgque_queue_events_total', q.seq::float8),
         ('pgque_queue_events_since_last_tick',
          (q.seq - least(coalesce(q.tick_event_seq, 0), q.seq))::float8),
         ('pgque_queue_last_tick_age_seconds', date_part('epoch', now() - q.tick_time)),
         ('pgque_queue_stalled',
          pgque._queue_stalled(q.queue_id, q.tick_id, now() - q.tick_time,
                               q.stalled_after)::integer::float8),
         ('pgque_queue_stalled_after_seconds', date_part('epoch', q.stalled_after)),
         ('pgque_queue_current_table', q.queue_cur_table::float8),
         ('pgque_queue_rotation_age_seconds', date_part('epoch', now() - q.queue_switch_time)),
         ('pgque_queue_rotation_period_seconds', date_part('epoch', q.queue_rotation_period))
     ) m(metric, value)
     where m.value is not null
    union all
    select 'pgque_queue_table_size_bytes', q.queue_label || ',table="' || n::text || '"',
           greatest(c.relpages, 0)::float8 * current_setting('block_size')::float8
      from queues q
     cross join lateral generate_series(0, q.queue_ntables - 1) n
      -- _event_table, written out; the catalog's unique (relname, relnamespace).
      join pg_class c
        on c.relnamespace = 'pgque'::regnamespace
       and c.relname = 'event_' || q.queue_id::text || '_' || n::text
    union all
    -- The consumer groups.
    select m.metric, g.group_label, m.value
      from groups g
      left join members n on n.cg_id = g.cg_id
     cross join lateral (values ('pgque_group_slots', g.cg_slots::float8),
                                ('pgque_group_members', coalesce(n.n, 0)::float8)
     ) m(metric, value)
    union all
    -- Plain consumers and slots.
    select f.prefix || m.metric, f.labels, m.value
      from figures f
     cross join lateral (values
         ('behind_events', f.behind),
         ('lag_seconds', f.lag),
         ('ticks_behind', f.ticks_behind),
         ('last_active_age_seconds', f.idle),
         ('retries_waiting', f.retries),
         ('dead_letters', f.dead),
         ('stalled', f.stalled::integer::float8),
         ('owned', case when f.slot is not null then f.owned::integer end),
         ('epoch', f.epoch),
         ('blocked_keys', case when f.slot is not null then f.blocked end),
         ('oldest_blocked_age_seconds', f.blocked_age)
     ) m(metric, value)
     where m.value is not null
    union all
    select 'pgque_slot_owner_info', f.labels || ',' || f.owner_label, 1
      from figures f
     where f.owned;
end
$$;
