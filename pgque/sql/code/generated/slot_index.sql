-- pgque: slot indexes, so that a slot reads only its own events.
--
-- A slot's batch is the queue's batch filtered by the routing formula
-- (pgque.slot_of). Without help, every slot of a group of N reads the whole
-- batch to keep one event in N. So each event table gets, for every slot
-- count N > 1 that a group of the queue uses, an index on
-- (the routing formula with N written out, ev_txid): a slot's read then
-- fetches only the rows of its hash class. The index is an access path and
-- nothing more: a table without it gives the same events, read the slower way.
--
-- Maintenance keeps the indexes in line with the groups (pgque.maint), each
-- pass in its own short transaction: subscribe and unsubscribe touch no
-- event table, so neither makes producers wait, in whatever transaction they
-- run. A pass builds an index only on a table it can lock within 50 ms and
-- that is small (_slot_index_build_limit), so that the build holds producers
-- for milliseconds; a busy or large table gets its index when maintenance
-- truncates it, empty.
--
-- The formula must match, character for character, the filter that
-- _batch_where writes, or the planner will not use the index: both take it
-- from pgque._slot_expr (consumers/read.sql).


-- pgque._slot_index_name(queue_id, n, slots): the name of event table n's
-- index for groups of slots slots. Built from integers only.
create or replace function pgque._slot_index_name(p_queue_id integer, p_n integer,
                                                  p_slots integer)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pgque._event_table(p_queue_id, p_n) || '_slots' || p_slots::text
$$;

-- pgque._slot_index_build_limit(): the largest event table (in bytes, its
-- heap on disk) that maintenance builds a slot index on while producers may
-- be waiting: about 10,000 events of a few hundred bytes, a few milliseconds.
create or replace function pgque._slot_index_build_limit()
returns bigint
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 4 * 1024 * 1024::bigint $$;

-- pgque._slot_counts_wanted(queue_id): the slot counts above 1 that the
-- queue's consumer groups use, ascending: those its event tables need an
-- index for.
create or replace function pgque._slot_counts_wanted(p_queue_id integer)
returns integer[]
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(array_agg(distinct g.cg_slots order by g.cg_slots), '{}')
      from pgque.consumer_group g
     where g.cg_queue = p_queue_id and g.cg_slots > 1
$$;

-- pgque._slot_indexes_on(queue_id, n): the slot counts that event table n of
-- the queue has a slot index for (by the index names _slot_index_name gives).
-- PL/pgSQL for its cached plan: maintenance asks at every pass, for every
-- table (as SQL with a SET clause it was planned at each call, 95 µs).
create or replace function pgque._slot_indexes_on(p_queue_id integer, p_n integer)
returns integer[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_table text := pgque._event_table(p_queue_id, p_n);
    -- to_regclass: a table that drop_queue dropped meanwhile has no index (the
    -- info views read queues their statement's snapshot still shows).
    v_oid oid := to_regclass(format('pgque.%I', v_table));
    v_have integer[];
begin
    if v_oid is null then
        return '{}';
    end if;
    select coalesce(array_agg(substring(c.relname from '_slots([0-9]+)$')::integer), '{}')
      into v_have
      from pg_index i join pg_class c on c.oid = i.indexrelid
     where i.indrelid = v_oid
       and c.relname ~ ('^' || v_table || '_slots[0-9]+$');
    return v_have;
end
$$;

-- pgque._slot_index_buildable(queue_id, n): whether event table n of the
-- queue is small enough for an index build while producers may wait
-- (_slot_index_build_limit).
create or replace function pgque._slot_index_buildable(p_queue_id integer, p_n integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_relation_size(format('pgque.%I', pgque._event_table(p_queue_id, p_n))::regclass)
           <= pgque._slot_index_build_limit()
$$;

-- pgque._sync_slot_indexes(queue_id, n, busy_wait): makes event table n of the
-- queue (null: every event table) have exactly one slot index per slot count
-- above 1 that a consumer group of the queue uses: creates the missing ones
-- and drops those no group needs. busy_wait bounds the wait for a table's
-- lock (a lock_timeout value such as '50ms'); a table still busy then is left
-- as it is and gets its indexes when maintenance next truncates it. Null
-- waits as long as it takes (for a caller that holds the table's lock).
-- A caller that does not hold the lock (busy_wait given) builds no index on
-- a table larger than _slot_index_build_limit() either: the build would hold
-- the table's producers for as long as it takes; that table, too, gets its
-- index at its next truncate. Returns how many indexes were created or
-- dropped.
--
-- The caller holds the queue's maintenance lock (pgque._lock_queue), so two
-- syncs of one queue never race to create the same index, and a truncate
-- never runs in the middle of one.
create or replace function pgque._sync_slot_indexes(p_queue_id integer, p_n integer,
                                                    p_busy_wait text)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_wanted integer[] := pgque._slot_counts_wanted(p_queue_id);
    v_lock_timeout text := current_setting('lock_timeout');
    v_ntables integer;
    v_table text;
    v_have integer[];
    v_build integer[];
    v_slots integer;
    v_changed integer := 0;
    v_here integer;
    n integer;
begin
    select q.queue_ntables into v_ntables from pgque.queue q where q.queue_id = p_queue_id;
    if not found then
        return 0;  -- dropped meanwhile
    end if;
    for n in 0 .. v_ntables - 1 loop
        continue when p_n is not null and n <> p_n;
        v_table := pgque._event_table(p_queue_id, n);
        v_have := pgque._slot_indexes_on(p_queue_id, n);
        continue when v_have @> v_wanted and v_wanted @> v_have;
        v_here := 0;
        v_build := v_wanted;
        if p_busy_wait is not null and not pgque._slot_index_buildable(p_queue_id, n) then
            v_build := '{}';  -- too big to index now: only drop, on this table
        end if;
        begin
            if p_busy_wait is not null then
                perform set_config('lock_timeout', p_busy_wait, true);
            end if;
            foreach v_slots in array v_build loop
                continue when v_slots = any(v_have);
                execute format('create index %I on pgque.%I (%s, ev_txid)',
                               pgque._slot_index_name(p_queue_id, n, v_slots), v_table,
                               pgque._slot_expr(v_slots));
                v_here := v_here + 1;
            end loop;
            foreach v_slots in array v_have loop
                continue when v_slots = any(v_wanted);
                execute format('drop index pgque.%I', pgque._slot_index_name(p_queue_id, n, v_slots));
                v_here := v_here + 1;
            end loop;
            perform set_config('lock_timeout', v_lock_timeout, true);
            v_changed := v_changed + v_here;
        exception when lock_not_available then
            -- Busy (a long insert into the current table, say): this table's
            -- slots read the slower way until its next truncate.
            perform set_config('lock_timeout', v_lock_timeout, true);
        end;
    end loop;
    return v_changed;
end
$$;

-- pgque._slot_indexes_due(queue_id): whether _sync_slot_indexes would change
-- anything now, without locking: an index no group needs, or one missing on a
-- table small enough to build it on. Read-only (for _maint_due).
create or replace function pgque._slot_indexes_due(p_queue_id integer)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_wanted integer[] := pgque._slot_counts_wanted(p_queue_id);
    v_have integer[];
    n integer;
begin
    for n in 0 .. coalesce((select q.queue_ntables from pgque.queue q
                             where q.queue_id = p_queue_id), 0) - 1 loop
        v_have := pgque._slot_indexes_on(p_queue_id, n);
        if not v_have <@ v_wanted
           or (not v_wanted <@ v_have and pgque._slot_index_buildable(p_queue_id, n)) then
            return true;
        end if;
    end loop;
    return false;
end
$$;

-- pgque._slot_indexes_lag(queue_id): whether an event table of the queue
-- lacks a slot index its groups need or has one none needs, buildable now or
-- not (for pgque.generated_code).
create or replace function pgque._slot_indexes_lag(p_queue_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pgque.queue q
                    cross join generate_series(0, q.queue_ntables - 1) n
                    cross join lateral pgque._slot_indexes_on(q.queue_id, n) h(have)
                    where q.queue_id = p_queue_id
                      and not (h.have @> pgque._slot_counts_wanted(q.queue_id)
                               and h.have <@ pgque._slot_counts_wanted(q.queue_id)))
$$;
