-- pgque: the engine's own state in rotating tables, emptied by TRUNCATE.
--
-- The cursor log and the ticks are written all the time: a cursor row per
-- receive and per ack of every subscription, a tick row per tick; the nack
-- records and the retry queue at every nack. Rows that
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
-- partition written now: one index probe. A switch sends the writes to the
-- other partition and copies over the current cursor of every subscription
-- whose receive lock is free; a subscription busy then is "not moved yet",
-- its cursor read in the partition left (a second probe), until its next
-- write or a later pass moves it. Once all have moved, the partition left
-- holds superseded rows only, and is emptied a period later. (A new
-- subscription, whose first cursor no switch would copy, holds the rotation
-- row FOR SHARE until it commits, and no switch comes meanwhile.)

-- The ticks. Ticks are found by queue and id in both partitions, and
-- nothing is copied: the partition not written is emptied once no queue
-- needs a tick in it (from the oldest last finished tick of its
-- subscriptions on, and its newest tick), as an event table is once every
-- consumer is past it. A lagging subscription holds it back, and the ticks
-- pile up in the partition written meanwhile, as events do.
--
-- The nack records: a batch's records all go to one partition, chosen by its
-- id against the last switch's boundary, and the partition of the batches
-- before that switch is emptied once none of them is open (_rotate_nacks).
-- The retry queue: a moved retry is marked by a row of pgque.retry_moved, not
-- deleted; the partition not written is emptied after its retries still
-- waiting are copied over (_rotate_retries).
--
-- Snapshots. TRUNCATE is not MVCC-safe: a statement whose snapshot is older
-- than the truncate and that takes its locks after it sees the partition
-- empty. A statement takes the locks of its own plan before its snapshot, but
-- a query inside a function it calls takes them later, under that snapshot.
-- That is why no rotation empties anything a current reader may need: a
-- truncated tick partition holds no tick any cursor names (a queue idle since
-- the switch gets a new tick instead, so that its consumers move on), and a
-- truncated cursor partition holds only rows superseded a whole period
-- before. A statement that still finds no cursor for a subscription gets
-- 40001 (_current_cursor); so does a REPEATABLE READ or SERIALIZABLE
-- transaction that would write a cursor after a switch its snapshot does not
-- see (_write_part), which would go to the partition left.


-- Locks. A rotation takes the rotation row FOR UPDATE NOWAIT, and the
-- partition it empties first without queueing for it, then queueing for at
-- most 25 ms (_lock_partition): a receive, an ack or a tick waits that long
-- at most, and the copy and the truncate, which come at the very end of
-- maint(), until its commit. A switch of the cursor log takes no lock a
-- receive or an ack holds: it copies the cursors of the subscriptions whose
-- receive locks are free (SKIP LOCKED), and the others move at their next
-- write or at a later pass. Whatever it cannot have, it leaves to the next
-- maintenance pass.

-- pgque._cursor_parts(): where the current cursors are, as of this
-- statement's snapshot: the partition written now (part), and while a switch
-- is moving the subscriptions over (_rotate_cursors), the partition left
-- (moved_from, else null), where a subscription that has not moved yet has
-- its newest row.
create or replace function pgque._cursor_parts(out part smallint, out moved_from smallint)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    -- PL/pgSQL, not SQL: a SQL function with a pinned search_path is planned
    -- again in every transaction (docs/design-notes.md), and this one is on
    -- every receive's path.
    select r.rt_part, case when r.rt_moving then (r.rt_part + 1) % r.rt_parts end
      into part, moved_from
      from pgque.rotation r where r.rt_name = 'cursor';
end
$$;

-- pgque._write_part(name, share): the partition of rotated table name to
-- write a row into, as of now. A transaction whose snapshot is older than
-- the statement (REPEATABLE READ, SERIALIZABLE) may see the partition a
-- switch has left. For the cursor log a write there would be lost: it gets
-- 40001 when the cursor log switched since its snapshot
-- (pgque.cursor_switch_seq, which a switch advances, is past the switch its
-- snapshot sees), without locking anything. (A retry written there is kept:
-- that partition is emptied only after its waiting retries are copied.) With share, the rotation row is locked FOR SHARE until the
-- transaction ends: for a writer that holds no receive lock (a new
-- subscription), so that no switch happens before it commits.
create or replace function pgque._write_part(p_name text, p_share boolean default false)
returns smallint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
begin
    if p_share then
        return (select r.rt_part from pgque.rotation r where r.rt_name = p_name for share);
    end if;
    select * into v_rotation from pgque.rotation r where r.rt_name = p_name;
    if p_name = 'cursor' and current_setting('transaction_isolation') <> 'read committed'
       and coalesce(pg_sequence_last_value('pgque.cursor_switch_seq'), 0)
           > v_rotation.rt_switch then
        raise exception using errcode = '40001',
            message = 'pgque rotated its cursor tables after this transaction''s snapshot',
            hint = 'Retry the transaction.';
    end if;
    return v_rotation.rt_part;
end
$$;

-- pgque._try_lock(statement, tries): runs statement, which takes locks with
-- NOWAIT, until it gets them, at most tries times, 5 ms apart; false when it
-- did not. Between tries it holds nothing, and it never queues: a session
-- that wants a lock it tries for never waits behind it.
create or replace function pgque._try_lock(p_statement text, p_tries integer)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    for i in 1 .. p_tries loop
        begin
            execute p_statement;
            return true;
        exception when lock_not_available then
            perform pg_sleep(0.005);  -- what it had taken is released with the block
        end;
    end loop;
    return false;
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

-- pgque._switch_rotation(name, part, moving): makes part the partition of
-- name written from now on (the caller holds the row, _lock_rotation). The
-- switch's number: for the cursor log the next value of
-- pgque.cursor_switch_seq (_write_part), for the nack records the boundary
-- of batch ids, the next one to be handed out (_nack_part); moving says
-- whether subscriptions are left to move (_rotate_cursors).
create or replace function pgque._switch_rotation(p_name text, p_part smallint,
                                                  p_moving boolean default false)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    update pgque.rotation
       set rt_part = p_part, rt_time = clock_timestamp(), rt_moving = p_moving,
           rt_switch = case p_name
                           when 'cursor' then nextval('pgque.cursor_switch_seq')
                           when 'nack' then coalesce(
                               pg_sequence_last_value('pgque.batch_id_seq'), 0) + 1
                           else rt_switch end
     where rt_name = p_name
$$;

-- pgque._lock_partition(table, part): locks partition part of rotated table
-- (pgque.cursor or pgque.tick) for its truncate: first without queueing for
-- it (_try_lock, for about 25 ms), then queueing for at most 25 ms, so that a
-- stream of short transactions that read the table cannot keep it out for
-- ever (those that come meanwhile wait behind it, that long at most); false
-- when it has not had the lock (the next pass tries again).
create or replace function pgque._lock_partition(p_table text, p_part smallint)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_lock_timeout text := current_setting('lock_timeout');
begin
    if pgque._try_lock(format('lock table pgque.%I in access exclusive mode nowait',
                              p_table || '_' || p_part), 5) then
        return true;
    end if;
    perform set_config('lock_timeout', '25ms', true);
    execute format('lock table pgque.%I in access exclusive mode', p_table || '_' || p_part);
    perform set_config('lock_timeout', v_lock_timeout, true);
    return true;
exception when lock_not_available then
    return false;
end
$$;

-- pgque._rotate_cursors(): the rotation of the cursor log, every rt_period.
-- When anything was written since the last switch, the switch: the writes go
-- to the other partition (emptied before) from then on, and the log is
-- "moving" (rt_moving): a subscription whose newest row is still in the
-- partition left is read there. Each subscription moves at its next cursor
-- write, or when maintenance copies its current cursor over, under its
-- receive lock, taken only if free (a subscription busy now moves itself by
-- its next write). Once every subscription has moved, the move ends, and a
-- period later the partition left, holding superseded rows only, is emptied
-- (so that only a statement older than that could still look into it).
-- Returns how many partitions it emptied, plus one if it switched, plus one
-- if it ended a move; null when it had nothing to do (an idle database
-- rotates nothing) or the rotation row was taken (another rotation, a
-- subscription being made): it tries again at the next pass.
create or replace function pgque._rotate_cursors()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_subs bigint;
    v_switch boolean := false;
    v_moving boolean;
    v_movers integer[];
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'cursor';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_subs := (select count(*) from pgque.subscription);
    if not v_rotation.rt_moving
       and (now() - v_rotation.rt_time < v_rotation.rt_period
            or (not exists (select from pgque.cursor c where c.cur_part = v_other)
                and (select count(*) from (select from pgque.cursor c
                                            where c.cur_part = v_rotation.rt_part
                                            limit v_subs + 1) x) <= v_subs)) then
        return null;  -- the look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('cursor') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    select * into v_rotation from pgque.rotation where rt_name = 'cursor';  -- as locked
    if not v_rotation.rt_moving then
        if exists (select from pgque.cursor c where c.cur_part = v_other) then
            if now() - v_rotation.rt_time < v_rotation.rt_period
               or not pgque._lock_partition('cursor', v_other) then
                return null;
            end if;
            execute format('truncate pgque.%I', 'cursor_' || v_other);
            v_done := 1;
        end if;
        if now() - v_rotation.rt_time < v_rotation.rt_period
           or (select count(*) from (select from pgque.cursor c
                                      where c.cur_part = v_rotation.rt_part
                                      limit v_subs + 1) x) <= v_subs then
            return nullif(v_done, 0);
        end if;
        v_switch := true;
        v_done := v_done + 1;
        v_other := v_rotation.rt_part;  -- the partition left
        v_rotation.rt_part := (v_other + 1) % v_rotation.rt_parts;
    end if;
    -- The subscriptions not moved yet whose receive lock is free: their
    -- receive locks; then (a new statement, so a fresh snapshot: what their
    -- writers committed before is seen) their current cursors copied over.
    v_movers := array(select s.sub_id from pgque.subscription s
                       where not exists (select from pgque.cursor n
                                          where n.cur_part = v_rotation.rt_part
                                            and n.cur_sub = s.sub_id)
                       order by s.sub_id
                         for update skip locked);
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                              cur_pos, cur_handed, cur_end, cur_time, cur_part)
    select c.cur_sub, c.cur_seq, c.cur_last_tick, c.cur_batch, c.cur_next_tick,
           c.cur_pos, c.cur_handed, c.cur_end, c.cur_time, v_rotation.rt_part
      from unnest(v_movers) m(sub_id)
     cross join lateral (select o.* from pgque.cursor o
                          where o.cur_part = v_other and o.cur_sub = m.sub_id
                          order by o.cur_seq desc limit 1) c
     where not exists (select from pgque.cursor n
                        where n.cur_part = v_rotation.rt_part and n.cur_sub = m.sub_id);
    v_moving := exists (select from pgque.subscription s
                         where not exists (select from pgque.cursor n
                                            where n.cur_part = v_rotation.rt_part
                                              and n.cur_sub = s.sub_id));
    if v_switch then
        -- The writes go over (to the partition the copies went to) with this commit.
        perform pgque._switch_rotation('cursor', v_rotation.rt_part, v_moving);
    elsif not v_moving then
        update pgque.rotation set rt_moving = false, rt_time = now() where rt_name = 'cursor';
        v_done := v_done + 1;
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

-- pgque._tick_idle_queues(part): makes a tick for each queue whose newest
-- tick is in tick partition part, unless another session is ticking it;
-- returns how many. Only under READ COMMITTED (_make_tick's rule): else none.
create or replace function pgque._tick_idle_queues(p_part smallint)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
    v_made integer := 0;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        return 0;
    end if;
    for v_queue in select q.* from pgque.queue q
                    where (pgque._last_tick(q.queue_id)).tick_part = p_part
                    order by q.queue_id loop
        if pgque._lock_queue(v_queue.queue_id, 'tick', false) then
            perform pgque._make_tick(v_queue);
            v_made := v_made + 1;
        end if;
    end loop;
    return v_made;
end
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
        -- Held by a subscription that has not moved past it. A queue with no
        -- tick since the switch (idle, its ticker_idle_period long) keeps its
        -- newest tick there: a tick now, an empty batch, lets its consumers
        -- move on at their next receive.
        perform pgque._tick_idle_queues(v_other);
        return null;
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

-- pgque._nack_part(batch_id): the partition of the nack records where the
-- records of batch batch_id go: the partition written now for a batch opened
-- since the last switch (batch_id at or above its rt_switch, the boundary),
-- the other one for an older batch. So every record of one batch goes to one
-- partition, whatever switch a nack's snapshot sees (_rotate_nacks switches
-- only while no batch below the boundary is open), and the key of
-- pgque.batch_nack catches a repeated nack in REPEATABLE READ too (40001).
-- Under READ COMMITTED the rotation row is read FOR SHARE, held until the
-- nack's transaction ends: a switch in flight has set its boundary below the
-- batch ids handed out before it commits, so a nack that read the row as it
-- was before would put such a batch's records in the other partition than a
-- nack after it; it waits for the switch instead (and no switch comes while
-- a nack holds the row). A REPEATABLE READ or SERIALIZABLE nack reads the
-- row its snapshot sees (FOR SHARE would fail it with 40001 after any
-- switch); for it that window remains (docs/design-notes.md).
create or replace function pgque._nack_part(p_batch_id bigint)
returns smallint
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
begin
    if current_setting('transaction_isolation') = 'read committed' then
        select * into v_rotation from pgque.rotation r where r.rt_name = 'nack' for share;
    else
        select * into v_rotation from pgque.rotation r where r.rt_name = 'nack';
    end if;
    return case when p_batch_id >= v_rotation.rt_switch then v_rotation.rt_part
                else (v_rotation.rt_part + 1) % v_rotation.rt_parts end;
end
$$;

-- pgque._open_batch_below(batch_id): whether a subscription has a batch open
-- whose id is below batch_id, or a cursor this snapshot cannot find (counted
-- as one, to be safe).
create or replace function pgque._open_batch_below(p_batch_id bigint)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.subscription s
                    cross join lateral pgque._current_cursor(s.sub_id, false) c
                    where c.cur_sub is null or c.cur_batch < p_batch_id)
$$;

-- pgque._rotate_nacks(): the rotation of the nack records. A record is needed
-- while its batch is open (it keeps a repeated nack from counting twice).
-- Records go to the partition of their batch (_nack_part): batches opened
-- since the last switch to the partition written, older ones to the other.
-- Once no batch older than the last switch is open, the other partition holds
-- only records of finished batches and is emptied; then, when rt_period has
-- passed and the partition written holds a record, the switch: the writes of
-- batches opened from now on go to the emptied one, and the boundary becomes
-- the next batch id. A batch held open holds both (the records pile up in
-- the partition written until it ends). Nothing is copied. Returns how many
-- partitions it emptied plus one if it switched; null when it had nothing to
-- do or its lock was busy.
create or replace function pgque._rotate_nacks()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'nack';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.batch_nack b where b.bn_part = v_other);
    if v_empty and (now() - v_rotation.rt_time < v_rotation.rt_period
                    or not exists (select from pgque.batch_nack b
                                    where b.bn_part = v_rotation.rt_part)) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._open_batch_below(v_rotation.rt_switch) then
        return null;  -- a batch older than the last switch is still open
    end if;
    if pgque._lock_rotation('nack') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('batch_nack', v_other) then
            return null;
        end if;
        if pgque._open_batch_below(v_rotation.rt_switch) then
            return null;  -- judged again once locked: no nack writes there now
        end if;
        execute format('truncate pgque.%I', 'batch_nack_' || v_other);
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and exists (select from pgque.batch_nack b where b.bn_part = v_rotation.rt_part) then
        -- Every batch id handed out so far is below the new boundary: those
        -- batches' records stay where they go now (the partition left).
        perform pgque._switch_rotation('nack', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._rotate_retries(): the rotation of the retry queue. A retry row is
-- needed until it is moved back into the log (_maint_retry marks it in
-- pgque.retry_moved, in the same partition). The partition not written is
-- emptied, with its marks, after the retries still waiting in it (due later)
-- are copied, with their numbers, into the partition written; then, when
-- rt_period has passed and the partition written holds a row, the switch.
-- Returns how many partitions it emptied plus one if it switched; null when
-- it had nothing to do or its lock was busy. (A mover whose snapshot predates
-- the copy and that reads the partitions after it sees neither the rows
-- emptied nor their copies: it moves them at its next pass, never twice.)
create or replace function pgque._rotate_retries()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'retry';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.retry_queue r where r.rq_part = v_other)
               and not exists (select from pgque.retry_moved m where m.rm_part = v_other);
    if v_empty and (now() - v_rotation.rt_time < v_rotation.rt_period
                    or not exists (select from pgque.retry_queue r
                                    where r.rq_part = v_rotation.rt_part)) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('retry') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('retry_queue', v_other) then
            return null;
        end if;
        if not pgque._lock_partition('retry_moved', v_other) then
            return null;
        end if;
        -- Locked: no nack or mover writes there now, and this statement's
        -- snapshot sees all they committed.
        insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time,
                                       ev_retry, ev_type, ev_data, ev_extra1, ev_delayed_id,
                                       rq_id, rq_part)
        select r.ev_retry_after, r.ev_queue, r.ev_owner, r.ev_id, r.ev_time,
               r.ev_retry, r.ev_type, r.ev_data, r.ev_extra1, r.ev_delayed_id, r.rq_id,
               v_rotation.rt_part
          from pgque._retry_waiting r
         where r.rq_part = v_other;
        execute format('truncate pgque.%I, pgque.%I',
                       'retry_queue_' || v_other, 'retry_moved_' || v_other);
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and exists (select from pgque.retry_queue r where r.rq_part = v_rotation.rt_part) then
        perform pgque._switch_rotation('retry', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._rotate_held(): the rotation of the held events of blocked keys
-- (slots/pause.sql), as the retry queue's: a held event is needed while its
-- key's marker has not moved past it. The partition not written is emptied
-- after the held events still needed in it are copied, with their numbers,
-- into the partition written; then, when rt_period has passed and the
-- partition written holds a row, the switch. Returns how many partitions it
-- emptied plus one if it switched; null when it had nothing to do or its lock
-- was busy. The copy and the truncate commit together, so a reader sees the
-- rows or their copies, never both and never neither.
create or replace function pgque._rotate_held()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_empty boolean;                 -- the other partition is empty
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'held';
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    v_empty := not exists (select from pgque.held_event h where h.he_part = v_other);
    if v_empty and (now() - v_rotation.rt_time < v_rotation.rt_period
                    or not exists (select from pgque.held_event h
                                    where h.he_part = v_rotation.rt_part)) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('held') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    if not v_empty then
        if not pgque._lock_partition('held_event', v_other) then
            return null;
        end if;
        -- Locked: no receive or ack writes there now, and this statement's
        -- snapshot sees all they committed.
        insert into pgque.held_event (he_sub, he_key, he_seq, he_batch, ev_id, ev_time, ev_txid,
                                      ev_retry, ev_type, ev_data, ev_delayed_id, he_part)
        select h.he_sub, h.he_key, h.he_seq, h.he_batch, h.ev_id, h.ev_time, h.ev_txid,
               h.ev_retry, h.ev_type, h.ev_data, h.ev_delayed_id, v_rotation.rt_part
          from pgque.held_event h
          join pgque.blocked_key b on b.bk_sub = h.he_sub and b.bk_key = h.he_key
         where h.he_part = v_other and h.he_seq > b.bk_done_seq;
        execute format('truncate pgque.%I', 'held_event_' || v_other);
        v_done := 1;
    end if;
    if now() - v_rotation.rt_time >= v_rotation.rt_period
       and exists (select from pgque.held_event h where h.he_part = v_rotation.rt_part) then
        perform pgque._switch_rotation('held', v_other);
        v_done := v_done + 1;
    end if;
    return nullif(v_done, 0);
end
$$;

-- pgque._rotate_delayed(): the rotation of the delayed events (log/delay.sql).
-- A delayed row is needed until its queue's newest tick has moved it into the
-- log; the rows of a dropped queue are not needed. Once per rt_period (rt_time
-- is the last look, or switch), when the table holds anything, it counts the
-- rows needed and not in the partition not written: when those not needed
-- (there, and in the one written, which the next look empties) are at least
-- as many as those needed there, it copies those into the partition written
-- as they are (under their queues' tick locks, so no tick judges them in
-- between), empties the other with TRUNCATE and switches to it. Each row copied is so paid for by one emptied, and the rows
-- kept that are not needed are fewer than those needed plus a period's sends.
-- When the partition not written is empty already, the switch alone. Returns
-- how many partitions it emptied plus one if it switched; null when it did
-- nothing of either, or its lock was busy.
create or replace function pgque._rotate_delayed()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_counts record;
    v_queue integer;
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'delayed';
    if now() - v_rotation.rt_time < v_rotation.rt_period
       or not exists (select from pgque.delayed_event) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('delayed') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or ran since the look
    end if;
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    -- Needed or not, as of each queue's newest tick (its snapshot aside:
    -- a count to decide by, not the copy).
    with last as (select t.* from pgque.queue q cross join lateral pgque._last_tick(q.queue_id) t)
    select count(*) filter (where d.de_part = v_other and l.tick_queue is not null
                              and (l.tick_time is null or d.de_due > l.tick_time)) as needed,
           count(*) filter (where d.de_part = v_other
                              and (l.tick_queue is null or d.de_due <= l.tick_time)) as done_other,
           count(*) filter (where d.de_part = v_rotation.rt_part
                              and (l.tick_queue is null or d.de_due <= l.tick_time)) as done_written,
           count(*) filter (where d.de_part = v_other) as other
      into v_counts
      from pgque.delayed_event d left join last l on l.tick_queue = d.de_queue;
    if v_counts.other > 0 and v_counts.done_other + v_counts.done_written >= v_counts.needed then
        -- The tick locks of the queues with rows there, without waiting: no
        -- tick runs while the rows are copied, so each queue's newest tick
        -- stays the one that judged them, and the copies keep their
        -- transaction ids (a tick reads them as it read the originals).
        -- Before the partition's lock, in the ticks' own order.
        for v_queue in select q.queue_id from pgque.queue q
                        where exists (select from pgque.delayed_event d
                                       where d.de_part = v_other and d.de_queue = q.queue_id)
                        order by q.queue_id loop
            if not pgque._lock_queue(v_queue, 'tick', false) then
                return null;  -- a tick runs: the next pass
            end if;
        end loop;
        if not pgque._lock_partition('delayed_event', v_other) then
            return null;
        end if;
        -- Locked: no tick moves rows from there now, no sender writes there,
        -- and this statement's snapshot sees all they committed.
        insert into pgque.delayed_event (de_queue, de_due, ev_id, ev_time, ev_txid, ev_type,
                                         ev_data, ev_extra1, de_part)
        select d.de_queue, d.de_due, d.ev_id, d.ev_time, d.ev_txid, d.ev_type, d.ev_data,
               d.ev_extra1, v_rotation.rt_part
          from pgque.delayed_event d
          join pgque.queue q on q.queue_id = d.de_queue
         cross join lateral pgque._last_tick(q.queue_id) l
         where d.de_part = v_other
           and not coalesce(d.de_due <= l.tick_time
                            and pg_visible_in_snapshot(d.ev_txid, l.tick_snapshot), false);
        execute format('truncate pgque.%I', 'delayed_event_' || v_other);
        v_done := 1;
    end if;
    if v_done = 1 or v_counts.other = 0 then
        perform pgque._switch_rotation('delayed', v_other);
        return v_done + 1;
    end if;
    -- Not worth it yet: look again a period from now.
    update pgque.rotation set rt_time = now() where rt_name = 'delayed';
    return null;
end
$$;

-- pgque._rotate_idempotency(): the rotation of the idempotency keys
-- (log/idempotency.sql). Every key in the partition not written was recorded
-- before the last switch (rt_time); once the longest idempotency window of any
-- queue has passed since, all of them have expired: it empties that partition
-- with TRUNCATE, and switches the writes to it, under the table in SHARE mode,
-- which it has only while no sender is in flight (it tries, never queues).
-- A key is so remembered for one to two windows. Returns how many partitions
-- it emptied plus one if it switched; null when it did nothing of either.
create or replace function pgque._rotate_idempotency()
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rotation pgque.rotation;
    v_other smallint;
    v_done integer := 0;
begin
    select * into v_rotation from pgque.rotation where rt_name = 'idempotency';
    if now() - v_rotation.rt_time < coalesce((select max(q.queue_idempotency_window)
                                                 from pgque.queue q), interval '24 hours')
       or not exists (select from pgque.idempotency_key) then
        return null;  -- the cheap look, without a lock: nothing to do
    end if;
    if pgque._lock_rotation('idempotency') is distinct from v_rotation.rt_part then
        return null;  -- another rotation runs, or a REPEATABLE READ sender holds the row
    end if;
    v_other := (v_rotation.rt_part + 1) % v_rotation.rt_parts;
    if exists (select from pgque.idempotency_key k where k.ik_part = v_other) then
        if not pgque._lock_partition('idempotency_key', v_other) then
            return null;
        end if;
        execute format('truncate pgque.%I', 'idempotency_key_' || v_other);
        v_done := 1;
    end if;
    if not pgque._try_lock('lock table only pgque.idempotency_key in share mode nowait', 5) then
        return nullif(v_done, 0);  -- senders in flight: the switch at a later pass
    end if;
    perform pgque._switch_rotation('idempotency', v_other);
    return v_done + 1;
end
$$;
