-- pgque: ticks.
--
-- A tick stores pg_current_snapshot() and the position of the queue's event
-- sequence. Consecutive ticks of a queue must be taken in snapshot order, or
-- a batch could miss events: ticks of one queue are serialized by the queue's
-- tick lock, its 'tick' row of pgque.queue_lock taken FOR UPDATE, and each
-- snapshot is taken in a statement after that lock is granted, which in READ
-- COMMITTED means after the previous tick committed. Ticks of different
-- queues take different rows and never wait for each other.
--
-- Taking the row assigns a transaction id and writes WAL, so the ticker
-- first looks, without it, whether a tick is due, and looks again once it
-- holds it: an idle poll writes nothing, and two tickers do not both tick.

-- pgque._tick_channel(queue_id): the NOTIFY channel announcing ticks of a queue.
create or replace function pgque._tick_channel(p_queue_id integer)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return ('pgque_tick_' || p_queue_id::text);
end
$$;

-- pgque.tick_channel(queue): the channel to LISTEN on to hear of new ticks of
-- a queue (one notification per tick, with an empty payload).
create or replace function pgque.tick_channel(p_queue text)
returns text
language sql stable
security definer
set search_path = pg_catalog, pg_temp
as $$ select pgque._tick_channel((pgque._queue_row(p_queue)).queue_id) $$;

-- pgque._make_tick(queue): makes a tick for the queue now, unconditionally, and
-- returns its id. Takes the queue's tick lock first, waiting for a tick in
-- progress elsewhere; raises PQ001 when the queue was dropped meanwhile, and
-- PQ008 outside READ COMMITTED, where the snapshot would be the
-- transaction's and could predate the previous tick. Then moves into the log
-- the delayed events the tick passes (delay.sql), for the tick after.
create or replace function pgque._make_tick(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_prev pgque.tick;
    v_tick pgque.tick;
    v_event_seq bigint;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        raise exception using errcode = 'PQ008',
            message = 'pgque ticks must be made in a READ COMMITTED transaction';
    end if;
    -- The queue's tick lock (held already when the ticker calls this). When
    -- it is gone, so is the queue: a drop committed while this waited.
    if not pgque._lock_queue(p_queue.queue_id, 'tick', true) then
        raise exception using errcode = 'PQ001', message = format('queue %L does not exist',
                                                          pgque._name_for_message(p_queue.queue_name));
    end if;
    v_prev := pgque._last_tick(p_queue.queue_id);
    -- The sequence position, read before the snapshot is taken: the insert
    -- below is a new statement, hence a new snapshot, after the lock too.
    v_event_seq := coalesce(pg_sequence_last_value(p_queue.queue_event_seq), 0);
    -- Its time is the clock's, never before the last tick's: the delayed
    -- events due by then are moved below (delay.sql).
    insert into pgque.tick (tick_queue, tick_id, tick_time, tick_snapshot, tick_event_seq,
                            tick_part)
    values (p_queue.queue_id, nextval('pgque.tick_id_seq'),
            greatest(clock_timestamp(), v_prev.tick_time), pg_current_snapshot(), v_event_seq,
            pgque._write_part('tick'))
    returning * into v_tick;
    -- The delayed events this tick passes, into the log for the next tick (the
    -- probes first: the move is planned at each call).
    if pgque._delayed_due(p_queue.queue_id, v_prev, v_tick.tick_time) then
        perform pgque._move_delayed(p_queue, v_prev, v_tick);
    end if;
    -- Wake the queue's consumers. The notification carries nothing: it only
    -- says "look now", and the consumers' poll covers for a lost one.
    perform pg_notify(pgque._tick_channel(p_queue.queue_id), '');
    return v_tick.tick_id;
end
$$;

-- pgque.tick(queue): forces a tick of one queue now; returns its id.
create or replace function pgque.tick(p_queue text)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    return pgque._make_tick(pgque._queue_row(p_queue));
end
$$;

-- pgque._last_tick(queue_id): the newest tick of a queue.
create or replace function pgque._last_tick(p_queue_id integer)
returns pgque.tick
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick pgque.tick;
begin
    select * into v_tick from pgque.tick where tick_queue = p_queue_id
     order by tick_id desc limit 1;
    return v_tick;
end
$$;

-- pgque._uncovered_events(queue_id, snapshot): whether any committed event of
-- the queue is not covered by a tick of snapshot, i.e. belongs to a
-- transaction not visible in it (at or past its xmax, or in its xip list).
-- Counting by sequence position cannot tell: an event whose ev_id was taken
-- before a tick by a transaction that committed after it lies below the
-- tick's position yet is not in its batch. An index probe on ev_txid, through
-- the queue's batch reader (its cover probe, consumers/read.sql: static SQL,
-- planned once per session, where a dynamic statement was planned at each of
-- the ticker's polls); transactions still in progress are invisible here and
-- simply skipped.
create or replace function pgque._uncovered_events(p_queue_id integer, p_snapshot pg_snapshot)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_req pgque.read_request;
begin
    v_req.prev_xmax := pg_snapshot_xmax(p_snapshot);
    v_req.prev_xip := array(select pg_snapshot_xip(p_snapshot));
    v_req.probe := true;
    return cardinality(pgque._run_reader(p_queue_id, v_req)) > 0;
end
$$;

-- pgque._tick_due(queue, last_tick, pending_only): whether the queue's
-- thresholds ask for a tick now: enough events pending (ticker_max_count), or
-- some pending for longer than ticker_max_lag, or none for ticker_idle_period;
-- with pending_only, whether any event is pending at all. Pending is
-- counted by sequence position since the last tick; when that says none, an
-- index probe checks for committed events the last tick did not cover, and
-- two more for a delayed event due and not moved (_delayed_due).
create or replace function pgque._tick_due(p_queue pgque.queue, p_last pgque.tick,
                                           p_pending_only boolean default false)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_pending bigint := coalesce(pg_sequence_last_value(p_queue.queue_event_seq), 0)
                        - coalesce(p_last.tick_event_seq, 0);
    v_age interval := now() - p_last.tick_time;
begin
    if v_pending <= 0 and p_last.tick_id is not null
       and pgque._uncovered_events(p_queue.queue_id, p_last.tick_snapshot) then
        v_pending := 1;
    end if;
    -- A delayed event due and not moved yet: the next tick moves it. (Where no
    -- queue has any, one look at the empty table says so.)
    if v_pending <= 0 and exists (select from pgque.delayed_event)
       and pgque._delayed_due(p_queue.queue_id, p_last, clock_timestamp()) then
        v_pending := 1;
    end if;
    if p_pending_only then
        return v_pending > 0;
    end if;
    return p_last.tick_id is null
        or v_pending >= p_queue.queue_ticker_max_count
        or (v_pending > 0 and v_age >= p_queue.queue_ticker_max_lag)
        or v_age >= p_queue.queue_ticker_idle_period;
end
$$;

-- pgque._tick_wanted(queue, overdue): whether the queue should be ticked
-- now: with overdue null, whether its thresholds ask for a tick (_tick_due);
-- otherwise whether it has pending events and its last tick is at least
-- overdue old. Reads only.
create or replace function pgque._tick_wanted(p_queue pgque.queue, p_overdue interval)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_last pgque.tick := pgque._last_tick(p_queue.queue_id);
begin
    if p_overdue is not null and now() - v_last.tick_time < p_overdue then
        return false;
    end if;
    return pgque._tick_due(p_queue, v_last, p_overdue is not null);
end
$$;

-- pgque._tick_wanted_nowait(queue, overdue): _tick_wanted for the look taken
-- before the tick lock, which must neither wait nor fail: true when it cannot
-- tell at once, and the caller decides under the lock. A drop_queue holds
-- the queue's tables and sequence exclusively until it commits, and then they
-- are gone: reading them would wait for the drop and then fail, so every lock
-- is waited for at most 1 ms, and any error is left to the look under the
-- lock (which a drop never gets past, and which raises a real error again).
-- Reads only: the caught error costs a subtransaction without a transaction id.
create or replace function pgque._tick_wanted_nowait(p_queue pgque.queue, p_overdue interval)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
begin
    return pgque._tick_wanted(p_queue, p_overdue);
exception when others then
    return true;
end
$$;

-- pgque._tick_if_wanted(queue_id, overdue, wait): ticks the queue if
-- _tick_wanted says so, both before taking its tick lock (so a poll of an idle
-- queue takes no lock, assigns no transaction id and writes nothing) and
-- again under it, in a new statement that sees ticks committed meanwhile (so
-- two tickers do not both tick). The queue row is read again under the lock;
-- a queue dropped meanwhile is not touched. Without wait, a queue whose tick
-- lock is taken (being ticked or dropped elsewhere) is skipped at once.
-- Returns the new tick id, or null when none was made.
create or replace function pgque._tick_if_wanted(p_queue_id integer, p_overdue interval,
                                                 p_wait boolean)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
begin
    select * into v_queue from pgque.queue where queue_id = p_queue_id;
    if not found then
        return null;
    end if;
    if not pgque._tick_wanted_nowait(v_queue, p_overdue) then
        return null;
    end if;
    if not pgque._lock_queue(p_queue_id, 'tick', p_wait) then
        return null;
    end if;
    select * into v_queue from pgque.queue where queue_id = p_queue_id;
    if not found then
        return null;
    end if;
    if not pgque._tick_wanted(v_queue, p_overdue) then
        return null;
    end if;
    return pgque._make_tick(v_queue);
end
$$;

-- pgque.ticker(queue): ticks the queue if its thresholds ask for it; returns
-- the new tick id, or null when no tick was due. Waits for a tick of the
-- queue in progress elsewhere, then looks again.
create or replace function pgque.ticker(p_queue text)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    return pgque._tick_if_wanted((pgque._queue_row(p_queue)).queue_id, null, true);
end
$$;

-- pgque._ticker(overdue): ticks every queue whose thresholds ask for it;
-- with overdue, only those whose pending events have waited at least that
-- long since the queue's last tick. Returns how many ticks were made.
--
-- Lock order, shared with drop_queue and maintenance: a queue's tick lock
-- first, then its rows and tables. A queue whose tick lock is taken (being
-- ticked or dropped elsewhere) is skipped without waiting, and the queue row
-- is read again once the lock is held, so a queue dropped meanwhile is not
-- touched (see _tick_if_wanted).
create or replace function pgque._ticker(p_overdue interval)
returns integer
language sql
set search_path = pg_catalog, pg_temp
as $$ select s.ticks from pgque._ticker_some(p_overdue, null, null) s $$;

-- pgque._ticker_some(overdue, after, max_queues): _ticker for the queues
-- whose ids are above after (null: from the first), at most max_queues of
-- them (null: every one), in id order. Returns the ticks made and the id of
-- the last queue it looked at, or null when no queue is left after it (so
-- that a poll of fewer queues than max_queues is one call). A look reads an
-- event table of the queue and keeps a lock on it until the transaction
-- ends: a statement over thousands of queues outgrows the server's lock
-- table ("out of shared memory"), so the tickers go through them a few
-- hundred per statement (pgque.ticker_some).
create or replace function pgque._ticker_some(p_overdue interval, p_after integer,
                                              p_max_queues integer,
                                              out ticks integer, out last_queue integer)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_id integer;
    v_looked integer := 0;
begin
    ticks := 0;
    -- One queue more than asked: whether any is left after the chunk.
    for v_id in select q.queue_id from pgque.queue q
                 where p_after is null or q.queue_id > p_after
                 order by q.queue_id limit p_max_queues + 1 loop
        if v_looked = p_max_queues then
            return;  -- last_queue: the chunk's last, and more after it
        end if;
        v_looked := v_looked + 1;
        last_queue := v_id;
        if pgque._tick_if_wanted(v_id, p_overdue, false) is not null then
            ticks := ticks + 1;
        end if;
    end loop;
    last_queue := null;  -- none left
end
$$;

-- pgque.ticker_some(after, max_queues, overdue): ticker() (overdue null) or
-- tick_overdue(overdue) for at most max_queues queues (at least 1, else
-- 22023) whose ids are above after (null: from the first), in id order;
-- returns the ticks made and the last queue id looked at, null when no queue
-- is left after it: call it again with that id until then, each call its own
-- transaction, so that no transaction holds locks on every queue's tables.
create or replace function pgque.ticker_some(p_after integer, p_max_queues integer,
                                             p_overdue interval default null,
                                             out ticks integer, out last_queue integer)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_max_queues is null or p_max_queues < 1 then
        raise exception using errcode = '22023', message = 'max_queues must be at least 1';
    end if;
    if p_overdue < interval '0' then
        raise exception using errcode = '22023', message = 'after must not be negative';
    end if;
    select s.ticks, s.last_queue into ticks, last_queue
      from pgque._ticker_some(p_overdue, p_after, p_max_queues) s;
end
$$;

-- pgque.ticker(): ticks every queue whose thresholds ask for it; returns how
-- many ticks were made.
create or replace function pgque.ticker()
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    return pgque._ticker(null);
end
$$;

-- pgque.tick_overdue(after): ticks every queue with pending events that have
-- waited at least after since its last tick, whatever its thresholds; returns
-- how many ticks were made. This is the standby tickers' safety net: when the
-- elected ticker is frozen or cut off (its session, and so its election lock,
-- still alive), delivery goes on with a delay of about after. Ticks of one
-- queue stay serialized, so running it beside the elected ticker is safe.
create or replace function pgque.tick_overdue(p_after interval)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_after is null or p_after < interval '0' then
        raise exception using errcode = '22023', message = 'after must not be negative';
    end if;
    return pgque._ticker(p_after);
end
$$;
