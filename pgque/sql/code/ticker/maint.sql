-- pgque: maintenance (event table rotation, retry re-insertion; the rotation
-- of the cursor log, the ticks, the nack records and the retry queue is in
-- rotation.sql).
--
-- Each step is safe to run concurrently and repeatedly: steps of one queue
-- are serialized by the queue's maintenance lock, its 'maint' row of
-- pgque.queue_lock taken FOR UPDATE, and a second caller skips the queue
-- without waiting. Taking the row assigns a transaction id and writes WAL,
-- so maint() first looks, without it, whether any step has work
-- (_maint_due): maintenance of an idle queue, run every second, writes
-- nothing.

-- pgque._consumed_floor(queue_id): a transaction id below which every event
-- of the queue has been consumed by every subscription: the lowest xmin of the
-- subscriptions' last finished ticks (with no subscription, of the newest
-- tick). Null when unknown.
create or replace function pgque._consumed_floor(p_queue_id integer)
returns xid8
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when exists (select 1 from pgque.subscription where sub_queue = p_queue_id)
           then (select min(pg_snapshot_xmin(t.tick_snapshot))
                   from pgque.subscription s
                   cross join lateral pgque._current_cursor(s.sub_id) c
                   join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick
                  where s.sub_queue = p_queue_id)
           else pg_snapshot_xmin((pgque._last_tick(p_queue_id)).tick_snapshot)
           end
$$;

-- pgque._maint_rotate(queue): truncates every event table other than the
-- current one whose events all subscriptions have consumed, then switches
-- the current table when rotation_period has passed and the next table is
-- empty. Returns the number of tables truncated plus one if it switched.
-- Records in queue_used_tables the tables other than the current one that
-- may still hold events: those it did not find empty or empty them, and the
-- one it switched away from (see _maint_look).
--
-- A producer that read the old current table just before a switch may still
-- be inserting into it. The table is therefore locked before it is judged:
-- the lock waits for such writers to finish, and only then is its newest
-- ev_txid compared with the consumed floor. The lock wait is bounded so a
-- long transaction stalls rotation, never consumers.
create or replace function pgque._maint_rotate(p_queue pgque.queue)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_floor xid8 := pgque._consumed_floor(p_queue.queue_id);
    v_lock_timeout text := current_setting('lock_timeout');
    v_table text;
    v_nonempty boolean;
    v_max xid8;
    v_done integer := 0;
    v_used bigint := 0;
    n integer;
begin
    for n in 0 .. p_queue.queue_ntables - 1 loop
        continue when n = p_queue.queue_cur_table;
        v_table := pgque._event_table(p_queue.queue_id, n);
        execute format('select exists (select 1 from pgque.%I)', v_table) into v_nonempty;
        if not v_nonempty and p_queue.queue_used_tables & (1::bigint << n) <> 0 then
            -- Unmarked only if no insert is in flight (a producer that read
            -- the queue row before the switch, its transaction still open):
            -- a SHARE lock, without waiting, then the look again.
            begin
                execute format('lock table pgque.%I in share mode nowait', v_table);
                execute format('select exists (select 1 from pgque.%I)', v_table) into v_nonempty;
            exception when lock_not_available then
                v_nonempty := true;
            end;
        end if;
        continue when not v_nonempty;
        v_used := v_used | (1::bigint << n);  -- unless emptied below
        continue when v_floor is null;
        begin
            perform set_config('lock_timeout', '50ms', true);
            execute format('lock table pgque.%I in access exclusive mode', v_table);
            perform set_config('lock_timeout', v_lock_timeout, true);
            execute format('select max(ev_txid) from pgque.%I', v_table) into v_max;
            if v_max is null or v_max < v_floor then
                execute format('truncate pgque.%I', v_table);
                -- Empty and locked: the cheapest moment to bring its slot
                -- indexes in line with the queue's groups.
                perform pgque._sync_slot_indexes(p_queue.queue_id, n, null);
                v_done := v_done + 1;
                v_used := v_used & ~(1::bigint << n);
            end if;
        exception when lock_not_available then
            null;  -- busy: try again at the next maintenance pass
        end;
    end loop;

    if now() - p_queue.queue_switch_time >= p_queue.queue_rotation_period then
        n := (p_queue.queue_cur_table + 1) % p_queue.queue_ntables;
        execute format('select exists (select 1 from pgque.%I)',
                       pgque._event_table(p_queue.queue_id, n))
           into v_nonempty;
        if not v_nonempty then
            update pgque.queue
               set queue_cur_table = n, queue_switch_time = now(),
                   queue_used_tables = (v_used | (1::bigint << p_queue.queue_cur_table))
                                       & ~(1::bigint << n)
             where queue_id = p_queue.queue_id;
            return v_done + 1;
        end if;
    end if;
    if v_used <> p_queue.queue_used_tables then
        update pgque.queue set queue_used_tables = v_used where queue_id = p_queue.queue_id;
    end if;
    return v_done;
end
$$;

-- pgque._ticks_kept_from(queue_id): the oldest tick of the queue that a
-- subscription may still need: the oldest last finished tick of its
-- subscriptions; with no subscription, its newest tick.
create or replace function pgque._ticks_kept_from(p_queue_id integer)
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce((select min(c.cur_last_tick)
                       from pgque.subscription s cross join lateral pgque._current_cursor(s.sub_id) c
                      where s.sub_queue = p_queue_id),
                    (pgque._last_tick(p_queue_id)).tick_id)
$$;

-- pgque._maint_due(queue): whether any maintenance step has work for the
-- queue, looked at without its maintenance lock and without writing: a
-- table to truncate (a non-current event table, not empty, whose newest
-- event is below the consumed floor) or to switch to (rotation_period passed
-- and the next table is empty), a due retry, a slot index to make or drop
-- (_slot_indexes_due), a batch reader to write again (_batch_reader_due), a
-- table found empty that queue_used_tables still marks.
-- Each test is the one its step applies, so it never says no while a step
-- would act.
-- (Rows of a transaction still in progress are not seen; they would not be
-- seen by the step either, and an in-progress transaction's id is never
-- below the consumed floor.) It must neither wait nor fail: locks are waited
-- for at most 1 ms (a drop_queue holds the queue's tables until it commits,
-- a running truncate holds one), and when it cannot tell it says yes, and
-- the steps decide under the lock.
create or replace function pgque._maint_due(p_queue pgque.queue)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
declare
    v_floor xid8;
    v_max xid8;
    v_nonempty boolean;
    n integer;
begin
    begin
        if exists (select 1 from pgque._retry_waiting r
                    where r.ev_queue = p_queue.queue_id and r.ev_retry_after <= now()) then
            return true;
        end if;
        if pgque._slot_indexes_due(p_queue.queue_id) or pgque._batch_reader_due(p_queue.queue_id) then
            return true;
        end if;
        if now() - p_queue.queue_switch_time >= p_queue.queue_rotation_period then
            execute format('select exists (select 1 from pgque.%I)',
                           pgque._event_table(p_queue.queue_id,
                                              (p_queue.queue_cur_table + 1) % p_queue.queue_ntables))
               into v_nonempty;
            if not v_nonempty then
                return true;
            end if;
        end if;
        v_floor := pgque._consumed_floor(p_queue.queue_id);
        for n in 0 .. p_queue.queue_ntables - 1 loop
            continue when n = p_queue.queue_cur_table
                          or (v_floor is null and p_queue.queue_used_tables & (1::bigint << n) = 0);
            execute format('select max(ev_txid) from pgque.%I', pgque._event_table(p_queue.queue_id, n))
               into v_max;
            -- A table to truncate, or one found empty that is still marked in use.
            if v_max < v_floor
               or (v_max is null and p_queue.queue_used_tables & (1::bigint << n) <> 0) then
                return true;
            end if;
        end loop;
        return false;
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see _seq_before)
    end;
    return true;
exception when lock_not_available then
    return true;
end
$$;

-- pgque._maint_look(): the queues a pass over all of them looks at closely
-- (_maint_due, then the steps), in one statement over every queue: a superset
-- of those where _maint_due says yes, from the queue rows and the catalog
-- only, never an event table: rotation_period passed (a switch may be due),
-- a table besides the current one marked in use (queue_used_tables: to
-- truncate once consumed), a retry due, a batch reader written for other slot
-- counts than the groups use (_batch_reader_due), or, for a queue with
-- groups of slots, an event table whose slot indexes are not those counts
-- (_slot_indexes_due). A slot index that no group needs any more on a queue
-- without groups is dropped when the groups change (the reader is written
-- again then) or, when its table was busy then, at the table's next
-- truncate. Reads only.
create or replace function pgque._maint_look()
returns setof integer
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select q.queue_id
      from pgque.queue q
     cross join lateral (select coalesce(array_agg(distinct g.cg_slots order by g.cg_slots), '{}')
                                as counts
                           from pgque.consumer_group g
                          where g.cg_queue = q.queue_id and g.cg_slots > 1) w
     where now() - q.queue_switch_time >= q.queue_rotation_period
        or q.queue_used_tables & ~(1::bigint << q.queue_cur_table) <> 0
        or exists (select from pgque._retry_waiting r
                    where r.ev_queue = q.queue_id and r.ev_retry_after <= now())
        -- _batch_reader_due, written out: as _generated_signature reads it
        or (select pgque._source_signature(p.prosrc)
              from pg_proc p
             where p.pronamespace = 'pgque'::regnamespace
               and p.proname = '_batch_reader_' || q.queue_id)
           is distinct from pgque._signature(q.queue_id || ':' || w.counts::text)
        -- _slot_indexes_on, written out, for every table of a queue with groups
        or (w.counts <> '{}'
            and exists (select from generate_series(0, q.queue_ntables - 1) n
                         cross join lateral (select 'event_' || q.queue_id || '_' || n as name) t
                         where (select coalesce(array_agg(split_part(ic.relname, '_slots', 2)::integer
                                                          order by 1), '{}')
                                  from pg_class tc
                                  join pg_index i on i.indrelid = tc.oid
                                  join pg_class ic on ic.oid = i.indexrelid
                                 where tc.relnamespace = 'pgque'::regnamespace
                                   and tc.relname = t.name
                                   and ic.relname like t.name || '\_slots%')
                               is distinct from w.counts))
     order by q.queue_id
$$;

-- pgque.maint(queue): runs every maintenance step for one queue (all queues
-- when null) and reports what it did as rows (queue_name, step, amount).
-- A queue whose maintenance is already running elsewhere (or that is being
-- dropped) is skipped, and so, without taking any lock, is a queue where no
-- step has work (_maint_due); a pass over all queues asks that only of the
-- queues _maint_look names. Every call then rotates the cursor log, the
-- ticks, the nack records, the retry queue, the held events, the delayed
-- events and the idempotency keys of all queues when they are due (steps
-- rotate_cursors, rotate_ticks, rotate_nacks, rotate_retries, rotate_held,
-- rotate_delayed and rotate_idempotency, queue_name null). A pass over all
-- queues also writes the event writer when it is due (step event_writer,
-- queue_name null) and deletes the leases expired for a minute (step
-- leases). PQ008 outside READ COMMITTED, as for a tick.
create or replace function pgque.maint(p_queue text default null)
returns table (queue_name text, step text, amount bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
#variable_conflict use_column
declare
    v_id integer;
    v_queue pgque.queue;
    v_amount bigint;
begin
    -- Its rotations copy what is still needed and then TRUNCATE: a snapshot
    -- older than the statement would copy less than was committed.
    if current_setting('transaction_isolation') <> 'read committed' then
        raise exception using errcode = 'PQ008',
            message = 'pgque maintenance must run in a READ COMMITTED transaction';
    end if;
    if p_queue is not null then
        perform pgque._queue_row(p_queue);
    end if;
    -- A pass over all queues looks closely only at those _maint_look names.
    for v_id in select q.queue_id from pgque.queue q
                 where q.queue_name = p_queue
                union all
                select l from pgque._maint_look() l
                 where p_queue is null
                 order by 1 loop
        -- The look without the lock, on the queue row as it is now (another
        -- maint may have rotated it since the loop began).
        select * into v_queue from pgque.queue q where q.queue_id = v_id;
        continue when not found;
        continue when not pgque._maint_due(v_queue);
        continue when not pgque._lock_queue(v_id, 'maint', false);
        -- Read again under the lock: drop_queue takes it too, so a queue
        -- dropped since the loop began is gone now and must not be touched.
        select * into v_queue from pgque.queue q where q.queue_id = v_id;
        continue when not found;
        -- The steps that judge what no subscription needs any more read every
        -- cursor: a statement whose snapshot a cursor rotation outran gets
        -- 40001 there (_current_cursor), and the step waits for the next pass.
        begin
            v_amount := pgque._maint_rotate(v_queue);
        exception when serialization_failure then
            v_amount := 0;
        end;
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'rotate'; amount := v_amount;
            return next;
            select * into v_queue from pgque.queue q where q.queue_id = v_queue.queue_id;
        end if;
        v_amount := pgque._maint_retry(v_queue);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'retry'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._sync_slot_indexes(v_queue.queue_id, null, '50ms');
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'slot_indexes'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._sync_batch_reader(v_queue.queue_id, false);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'batch_reader'; amount := v_amount;
            return next;
        end if;
    end loop;
    -- The event writer (generated/event_writer.sql) of every queue, and the
    -- readers of dropped queues, when a create_queue or drop_queue could not
    -- write or drop them: on passes over them all.
    if p_queue is null then
        v_amount := pgque._sync_event_writer(false);
        if v_amount > 0 then
            queue_name := null; step := 'event_writer'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._drop_orphan_readers(false);
        if v_amount > 0 then
            queue_name := null; step := 'batch_reader'; amount := v_amount;
            return next;
        end if;
        -- Leases expired a while ago (slots/lease.sql).
        v_amount := pgque._purge_leases();
        if v_amount > 0 then
            queue_name := null; step := 'leases'; amount := v_amount;
            return next;
        end if;
    end if;
    -- The rotated tables of all queues (ticker/rotation.sql), when due: the
    -- partitions emptied, plus one for a switch (and for the cursor log, one
    -- for a move ended). Last, so that the locks they take are held only
    -- until the commit that follows.
    v_amount := pgque._rotate_cursors();
    if v_amount is not null then
        queue_name := null; step := 'rotate_cursors'; amount := v_amount;
        return next;
    end if;
    begin
        v_amount := pgque._rotate_ticks();
    exception when serialization_failure then
        v_amount := null;
    end;
    if v_amount is not null then
        queue_name := null; step := 'rotate_ticks'; amount := v_amount;
        return next;
    end if;
    begin
        v_amount := pgque._rotate_nacks();
    exception when serialization_failure then
        v_amount := null;
    end;
    if v_amount is not null then
        queue_name := null; step := 'rotate_nacks'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_retries();
    if v_amount is not null then
        queue_name := null; step := 'rotate_retries'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_held();
    if v_amount is not null then
        queue_name := null; step := 'rotate_held'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_delayed();
    if v_amount is not null then
        queue_name := null; step := 'rotate_delayed'; amount := v_amount;
        return next;
    end if;
    v_amount := pgque._rotate_idempotency();
    if v_amount is not null then
        queue_name := null; step := 'rotate_idempotency'; amount := v_amount;
        return next;
    end if;
end
$$;
