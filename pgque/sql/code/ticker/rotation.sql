-- pgque: the engine's own state in rotating tables, emptied by TRUNCATE.
--
-- The cursor log and the ticks are written all the time: a cursor row per
-- receive and per ack of every subscription, a tick row per tick. Rows that
-- maintenance DELETEd would be dead rows for vacuum, and a transaction that
-- holds the xmin horizon back (a long report, a session idle in transaction,
-- a lagging replication slot) would pile them up for as long as it lasts. So
-- each of these tables is partitioned in two (migration 7): one partition is
-- written (pgque.rotation's rt_part), and the other is emptied with TRUNCATE
-- once nothing in it is needed, which removes its file and leaves nothing
-- for vacuum. Every rt_period (a minute) that something was written,
-- maintenance switches the writes to the emptied one. The row of
-- pgque.rotation is the only row updated: once per switch. An idle database
-- rotates nothing.
--
-- The cursor log. A subscription's current cursor is its newest row in the
-- partition written now: one index probe. So a switch first copies every
-- subscription's current cursor into the emptied partition, holding the
-- receive locks of all subscriptions (their rows FOR UPDATE), which every
-- cursor writer holds while it reads and writes (a new subscription, whose
-- first cursor is not among those copied, holds the rotation row FOR SHARE
-- instead, until it commits). The partition left holds superseded rows only,
-- and is emptied a period later.
--
-- The ticks. Ticks are found by queue and id in both partitions, and
-- nothing is copied: the partition not written is emptied once no queue
-- needs a tick in it (from the oldest last finished tick of its
-- subscriptions on, and its newest tick), as an event table is once every
-- consumer is past it. A lagging subscription holds it back, and the ticks
-- pile up in the partition written meanwhile, as events do.
--
-- Snapshots. TRUNCATE is not MVCC-safe: a statement whose snapshot is older
-- than the truncate and that takes its locks after it sees the partition
-- empty. A statement takes the locks of its own plan before its snapshot, but
-- a query inside a function it calls takes them later, under that snapshot.
-- That is why no rotation empties anything a current reader may need: a
-- truncated tick partition holds no tick any cursor names, and a truncated
-- cursor partition was left by a switch a whole period before, under every
-- receive lock, so that a receive or an ack, which reads its cursor after it
-- has its receive lock, never looks there. A REPEATABLE READ or SERIALIZABLE
-- transaction, whose snapshot may be older than a switch, gets a
-- serialization failure (40001) where it would write into the partition left
-- or miss its cursor (_write_part, _current_cursor).
--
-- Locks. A rotation takes the rotation row FOR UPDATE NOWAIT, then the
-- subscription rows (a switch of the cursor log) and the partition it empties,
-- each waited for at most 50 ms (lock_timeout): a receive, an ack or a tick
-- waits at most that long and the copy, and a rotation that cannot have its
-- locks gives up until the next maintenance pass.

-- pgque._rotation_part(name): the partition of rotated table name ('cursor',
-- 'tick') written now, as of this statement's snapshot.
create or replace function pgque._rotation_part(p_name text)
returns smallint
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select r.rt_part from pgque.rotation r where r.rt_name = p_name
$$;

-- pgque._write_part(name, share): the partition of rotated table name to
-- write a row into. Under READ COMMITTED the rotation row as of now; under a
-- snapshot kept for the transaction, the row locked FOR SHARE, which fails
-- (40001) once a rotation changed it after the snapshot: a write into the
-- partition a rotation left would be lost. With share, locked FOR SHARE
-- whatever the isolation: for a writer that holds no receive lock (a new
-- subscription), so that no rotation switches before it commits.
create or replace function pgque._write_part(p_name text, p_share boolean default false)
returns smallint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_share or current_setting('transaction_isolation') <> 'read committed' then
        return (select r.rt_part from pgque.rotation r where r.rt_name = p_name for share);
    end if;
    return (select r.rt_part from pgque.rotation r where r.rt_name = p_name);
end
$$;

-- pgque._lock_rotation(name): the rotation row of name FOR UPDATE, without
-- waiting; null when another rotation or a writer holding it FOR SHARE has it,
-- else the partition written now.
create or replace function pgque._lock_rotation(p_name text)
returns smallint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select r.rt_part from pgque.rotation r where r.rt_name = p_name
               for update nowait);
exception when lock_not_available then
    return null;
end
$$;

-- pgque._switch_rotation(name, part): makes part the partition of name
-- written from now on (the caller holds the row, _lock_rotation).
create or replace function pgque._switch_rotation(p_name text, p_part smallint)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    update pgque.rotation set rt_part = p_part, rt_time = now() where rt_name = p_name
$$;

-- pgque._lock_partition(table, part): locks partition part of rotated table
-- (pgque.cursor or pgque.tick) for its truncate, waiting at most 50 ms;
-- false when it has not had the lock (readers hold it: the next pass tries
-- again).
create or replace function pgque._lock_partition(p_table text, p_part smallint)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_lock_timeout text := current_setting('lock_timeout');
begin
    perform set_config('lock_timeout', '50ms', true);
    execute format('lock table pgque.%I in access exclusive mode', p_table || '_' || p_part);
    perform set_config('lock_timeout', v_lock_timeout, true);
    return true;
exception when lock_not_available then
    return false;
end
$$;

-- pgque._rotate_cursors(): the rotation of the cursor log, every rt_period.
-- The partition not written holds only superseded rows since the last switch
-- away from it: it is emptied a period after that switch (so that only a
-- statement older than that could still look into it). Then, if the partition
-- written holds more rows than the current cursors (anything was written
-- since the last switch), the switch: every subscription's current cursor
-- copied into the emptied partition, under all their receive locks, and that
-- one written from then on. Returns how many partitions it emptied
-- plus one if it switched; null when it had nothing to do (an idle database
-- rotates nothing) or its locks were busy (it tries again at the next pass).
-- One rotation at a time, by the rotation row's lock.
create or replace function pgque._rotate_cursors()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_subs bigint;
    v_done integer := 0;
    v_lock_timeout text := current_setting('lock_timeout');
begin
    select * into v_rotation from pgque.rotation where rt_name = 'cursor';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_subs := (select count(*) from pgque.subscription);
    if now() - v_rotation.rt_time < v_rotation.rt_period
       or (not exists (select from pgque.cursor c where c.cur_part = v_other)
           and (select count(*) from (select from pgque.cursor c
                                       where c.cur_part = v_rotation.rt_part
                                       limit v_subs + 1) x) <= v_subs) then
        return null;  -- the look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('cursor') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if exists (select from pgque.cursor c where c.cur_part = v_other) then
        if not pgque._lock_partition('cursor', v_other) then
            return null;
        end if;
        execute format('truncate pgque.%I', 'cursor_' || v_other);
        v_done := 1;
    end if;
    if (select count(*) from (select from pgque.cursor c
                               where c.cur_part = v_rotation.rt_part
                               limit v_subs + 1) x) > v_subs then
        begin
            -- Every receive lock, in one order: no cursor is written meanwhile.
            perform set_config('lock_timeout', '50ms', true);
            perform 1 from pgque.subscription s order by s.sub_id for update;
            perform set_config('lock_timeout', v_lock_timeout, true);
            insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                                      cur_pos, cur_handed, cur_end, cur_time, cur_part)
            select c.cur_sub, c.cur_seq, c.cur_last_tick, c.cur_batch, c.cur_next_tick,
                   c.cur_pos, c.cur_handed, c.cur_end, c.cur_time, v_other
              from pgque.subscription s
             cross join lateral (select o.* from pgque.cursor o
                                  where o.cur_part = v_rotation.rt_part and o.cur_sub = s.sub_id
                                  order by o.cur_seq desc limit 1) c;
            perform pgque._switch_rotation('cursor', v_other);
            v_done := v_done + 1;
        exception when lock_not_available then
            null;  -- a receive lock held: switch at a later pass
        end;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._ticks_kept(): for every queue, the oldest tick it may still read
-- (_ticks_kept_from: the oldest last finished tick of its subscriptions, or
-- its newest tick when it has none); a tick of the queue from there on is
-- needed, any other tick is not.
create or replace function pgque._ticks_kept(out queues integer[], out kept_from bigint[])
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(array_agg(q.queue_id), '{}'),
           coalesce(array_agg(pgque._ticks_kept_from(q.queue_id)), '{}')
      from pgque.queue q
$$;

-- pgque._needed_tick_in(part, queues, kept_from): whether tick partition part
-- holds a tick that a queue needs (queues and kept_from: _ticks_kept).
create or replace function pgque._needed_tick_in(p_part smallint, p_queues integer[],
                                                 p_kept_from bigint[])
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.tick t
                     join unnest(p_queues, p_kept_from) k(queue_id, kept_from)
                       on k.queue_id = t.tick_queue
                    where t.tick_part = p_part and t.tick_id >= k.kept_from)
$$;

-- pgque._unneeded_tick_in(part, queues, kept_from): whether tick partition
-- part holds a tick that no queue needs.
create or replace function pgque._unneeded_tick_in(p_part smallint, p_queues integer[],
                                                   p_kept_from bigint[])
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.tick t
                     left join unnest(p_queues, p_kept_from) k(queue_id, kept_from)
                       on k.queue_id = t.tick_queue
                    where t.tick_part = p_part
                      and (k.kept_from is null or t.tick_id < k.kept_from))
$$;

-- pgque._rotate_ticks(): the rotation of the ticks. The partition not written
-- is emptied once no queue needs any tick in it (as an event table is once
-- every consumer is past it): a lagging subscription holds it, and the ticks
-- pile up in the partition written until it moves on. The switch comes when
-- rt_period has passed, the partition not written is empty and the one
-- written holds a tick no queue needs. Returns how many partitions it emptied
-- plus one if it switched; null when it had nothing to do or its lock was busy.
-- (Nothing is copied: a tick a cursor names is never emptied, so no reader,
-- whatever its snapshot, misses a tick it needs; see above.)
create or replace function pgque._rotate_ticks()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_kept record;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'tick';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.tick t where t.tick_part = v_other);
    if v_empty and now() - v_rotation.rt_time < v_rotation.rt_period then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    v_kept := pgque._ticks_kept();
    if not v_empty and pgque._needed_tick_in(v_other, v_kept.queues, v_kept.kept_from) then
        return null;  -- held by a subscription that has not moved past it
    end if;
    if v_empty and not pgque._unneeded_tick_in(v_rotation.rt_part, v_kept.queues,
                                               v_kept.kept_from) then
        return null;  -- nothing to switch away from
    end if;
    if pgque._lock_rotation('tick') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('tick', v_other) then
            return null;
        end if;
        -- Judged again once locked: a new subscription starts at its queue's
        -- newest tick, which may be there.
        v_kept := pgque._ticks_kept();
        if pgque._needed_tick_in(v_other, v_kept.queues, v_kept.kept_from) then
            return null;
        end if;
        execute format('truncate pgque.%I', 'tick_' || v_other);
        v_empty := true;
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and pgque._unneeded_tick_in(v_rotation.rt_part, v_kept.queues, v_kept.kept_from) then
        perform pgque._switch_rotation('tick', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;
