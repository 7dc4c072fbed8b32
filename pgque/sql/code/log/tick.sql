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
--
-- Settled ticks. Whether a tick is due is counted by the queue's sequence,
-- except for one race: a transaction T that took an event id before the tick
-- read the sequence, and committed after the tick took its snapshot, left an
-- event the tick does not cover and the sequence does not count. Only an index
-- probe of the event tables finds it (_uncovered_events), and probing every
-- idle queue at every poll was most of the cost of a poll. So a tick records
-- when T can no longer exist:
--   * every sender assigns its transaction id before it takes an event id
--     (send.sql, and the retries and replays, which insert before nextval);
--   * the tick knows the sequence as it was before its own transaction had
--     an id (p_seq_before); when it reads the same value under the lock, no
--     id was taken between, so every T took its id, and so its transaction
--     id, before the tick's own: tick_settle_xid, the tick's own id, bounds
--     every T from above;
--   * once the oldest transaction running is past tick_settle_xid, every T
--     has ended; a probe then, in the same snapshot, that finds nothing finds
--     nothing ever after, and the poll marks the tick tick_settled
--     (_settle_tick); a tick whose snapshot shows no transaction running
--     below its own id is settled when made.
-- A settled tick is never probed again: an idle queue's poll is an index look
-- at its newest tick and a read of its sequence, in one statement for a chunk
-- of queues (_ticker_look). A tick without tick_settle_xid (the tick read the
-- sequence after its transaction had an id: a pgque.tick() inside a writing
-- transaction, or two tickers at once) is probed until the queue's next tick.

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
set jit = off
as $$ select pgque._tick_channel((pgque._queue_row(p_queue)).queue_id) $$;

-- pgque._make_tick(queue, seq_before): makes a tick for the queue now,
-- unconditionally, and returns its id. Takes the queue's tick lock first,
-- waiting for a tick in progress elsewhere; raises PQ001 when the queue was
-- dropped meanwhile, and PQ008 outside READ COMMITTED, where the snapshot
-- would be the transaction's and could predate the previous tick. Then moves
-- into the log the delayed events the tick passes (delay.sql), for the tick
-- after. seq_before: the queue's sequence as read before this transaction had
-- an id, or null (see "Settled ticks" at the top); settled: the caller knows
-- that no event can be missed (the queue was made in this transaction, its
-- sequence unseen by any other).
create or replace function pgque._make_tick(p_queue pgque.queue, p_seq_before bigint default null,
                                            p_settled boolean default false)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_prev pgque.tick;
    v_tick pgque.tick;
    v_event_seq bigint;
    v_settle_xid xid8;
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
    -- No event id taken since seq_before: every transaction this tick may miss
    -- has a lower id than this one (the top).
    if p_seq_before = v_event_seq then
        v_settle_xid := pg_current_xact_id();
    end if;
    -- Its time is the clock's, never before the last tick's: the delayed
    -- events due by then are moved below (delay.sql). Settled at once when its
    -- snapshot shows no transaction running below its own id.
    insert into pgque.tick (tick_queue, tick_id, tick_time, tick_snapshot, tick_event_seq,
                            tick_part, tick_settled, tick_settle_xid)
    values (p_queue.queue_id, nextval('pgque.tick_id_seq'),
            greatest(clock_timestamp(), v_prev.tick_time), pg_current_snapshot(), v_event_seq,
            pgque._write_part('tick'),
            p_settled
            or (v_settle_xid is not null
                and pg_snapshot_xmax(pg_current_snapshot()) >= v_settle_xid
                and not exists (select from pg_snapshot_xip(pg_current_snapshot()))),
            v_settle_xid)
    returning * into v_tick;
    -- The delayed events this tick passes, into the log for the next tick (the
    -- probes first: the move is planned at each call; where no queue has any,
    -- one look at the empty table). This transaction's own events are not in
    -- the tick: it is not settled after all.
    if exists (select from pgque.delayed_event)
       and pgque._delayed_due(p_queue.queue_id, v_prev, v_tick.tick_time) then
        if pgque._move_delayed(p_queue, v_prev, v_tick) > 0 and v_tick.tick_settled then
            update pgque.tick t set tick_settled = false
             where t.tick_queue = v_tick.tick_queue and t.tick_id = v_tick.tick_id
               and t.tick_part = v_tick.tick_part;
        end if;
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
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    return pgque._make_tick(v_queue, pgque._seq_before(v_queue));
end
$$;

-- Looks that must neither wait nor fail (_seq_before, _tick_wanted_nowait,
-- _settle_ready, _ticker_look, _maint_due; the info views' reads wait 100 ms)
-- wait for a lock at most lock_timeout and take an error for "cannot tell".
-- A wait whose lock is granted (a drop_queue commits) just as the timeout
-- fires leaves the timeout's cancel pending while the look fails on the
-- relation dropped meanwhile; PostgreSQL raises that cancel (55P03) at the
-- next statement, the first of the handler. So each such look is two blocks:
-- the inner one catches the look's error, the outer one the lock timeout its
-- handler may raise. And when the wait ends without an error (the holder
-- rolled back), the look's value is returned by a statement of its own inside
-- the inner block, which raises the cancel there: a RETURN of the look itself
-- left it to the caller's next statement.

-- pgque._seq_before(queue): the position of the queue's sequence, read now,
-- for a tick's seq_before (see the top): null when this transaction has an
-- id already. Neither waits nor fails (null instead): a drop_queue in
-- progress holds the sequence, and the tick lock, taken after, is what
-- waits for it and then says the queue is gone.
create or replace function pgque._seq_before(p_queue pgque.queue)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
declare
    v_seq bigint;
begin
    if pg_current_xact_id_if_assigned() is not null then
        return null;
    end if;
    begin
        v_seq := coalesce(pg_sequence_last_value(p_queue.queue_event_seq), 0);
        return v_seq;  -- (a statement of its own: see above)
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see above)
    end;
    return null;
exception when lock_not_available then
    return null;
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
-- counted by sequence position since the last tick; when that says none and
-- the last tick is not settled, an index probe checks for committed events
-- it did not cover, and two more for a delayed event due and not moved
-- (_delayed_due).
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
    if v_pending <= 0 and p_last.tick_id is not null and not p_last.tick_settled
       and pgque._uncovered_events(p_queue.queue_id, p_last.tick_snapshot) then
        v_pending := 1;
    end if;
    -- A delayed event due and not moved yet: the next tick moves it. (Where no
    -- queue has any, one look at the empty table says so.)
    if v_pending <= 0 and exists (select from pgque.delayed_event)
       and pgque._delayed_due(p_queue.queue_id, p_last, clock_timestamp(),
                              coalesce(p_last.tick_settled, false)) then
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
declare
    v_wanted boolean;
begin
    begin
        v_wanted := pgque._tick_wanted(p_queue, p_overdue);
        return v_wanted;  -- (a statement of its own: see _seq_before)
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see _seq_before)
    end;
    return true;
exception when lock_not_available then
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
-- Returns the new tick id, or null when none was made. seq_before: as for
-- _make_tick. sure: the caller has just seen that the thresholds ask for a
-- tick by the sequence alone (_ticker_look), so the look before the lock,
-- which would say so again, is skipped.
create or replace function pgque._tick_if_wanted(p_queue_id integer, p_overdue interval,
                                                 p_wait boolean, p_seq_before bigint default null,
                                                 p_sure boolean default false)
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
    if not p_sure and not pgque._tick_wanted_nowait(v_queue, p_overdue) then
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
    return pgque._make_tick(v_queue, p_seq_before);
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
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    return pgque._tick_if_wanted(v_queue.queue_id, null, true, pgque._seq_before(v_queue));
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
as $$ select s.ticks from pgque._ticker_some(p_overdue, null, null, null) s $$;

-- pgque._ticker_look(overdue, after, max_queues, queues): the look at a chunk
-- of queues that the tickers' poll starts with, one statement for all of them:
-- the queues whose ids are above after (null: from the first) and in queues
-- (null: any), at most max_queues plus one (null: every one), in id order, each with its
-- sequence's position (seq), whether a tick may be wanted (a superset of
-- _tick_wanted's answer, which decides under the lock: pending events by the
-- sequence, a threshold, the idle period, a delayed event due since the last
-- tick, or a last tick not settled, which only a probe can judge), whether
-- _tick_wanted would say yes now by the sequence and the clock alone (sure:
-- no probe needed; it says so again under the lock) and whether
-- its last tick may be settled now (settle: nothing pending by the sequence,
-- and the oldest transaction running is past its tick_settle_xid; see the
-- top). Reads only. Locks are waited for at most 1 ms: a drop_queue holds the
-- sequence it drops until it commits, and the caller falls back on a look
-- per queue when this fails.
create or replace function pgque._ticker_look(p_overdue interval, p_after integer,
                                              p_max_queues integer, p_queues integer[])
returns table (queue_id integer, seq bigint, wanted boolean, sure boolean, settle boolean)
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
#variable_conflict use_column
begin
    -- PL/pgSQL for its cached plan: the Ticker calls it every few milliseconds.
    return query
        select q.queue_id, s.seq, w.sure or w.maybe, w.sure,
               coalesce(s.seq <= t.tick_event_seq and not t.tick_settled
                        and pg_snapshot_xmin(pg_current_snapshot()) > t.tick_settle_xid, false)
          -- The queues named, by the primary key (one condition for both ways
          -- read every queue row: a hot poll of one queue among 5,000 took 1 ms).
          from (select u.*, row_number() over (order by u.queue_id) as n
                  from ((select l.* from pgque.queue l
                          where p_queues is null and (p_after is null or l.queue_id > p_after)
                          order by l.queue_id limit p_max_queues + 1)
                        union all
                        (select l.* from pgque.queue l
                          where l.queue_id = any(p_queues) and (p_after is null or l.queue_id > p_after)
                          order by l.queue_id limit p_max_queues + 1)) u
                 order by u.queue_id limit p_max_queues + 1) q
         -- (not the one past the chunk: its sequence stays unlocked)
         cross join lateral (select case when q.n <= p_max_queues or p_max_queues is null
                                         then coalesce(pg_sequence_last_value(q.queue_event_seq), 0)
                                    end as seq) s
          left join lateral (select l.tick_id, l.tick_time, l.tick_event_seq, l.tick_settled,
                                    l.tick_settle_xid
                               from pgque.tick l where l.tick_queue = q.queue_id
                              order by l.tick_id desc limit 1) t on true
         -- A delayed event due since the last tick (the first look of
         -- _delayed_due); where no queue has any, one look at the empty table.
         cross join lateral (select (select exists (select from pgque.delayed_event))
                                    and exists (select from pgque.delayed_event e
                                                 where e.de_queue = q.queue_id
                                                   and e.de_due > coalesce(t.tick_time, '-infinity')
                                                   and e.de_due <= clock_timestamp()) as due) d
         -- _tick_due's thresholds by the sequence (sure), or what a probe may
         -- find (maybe); with overdue, _tick_wanted's pending_only the same way.
         cross join lateral (select case when p_overdue is null
                                         then coalesce(t.tick_id is null
                                                       or s.seq - t.tick_event_seq >= q.queue_ticker_max_count
                                                       or (s.seq > t.tick_event_seq
                                                           and now() - t.tick_time >= q.queue_ticker_max_lag)
                                                       or now() - t.tick_time >= q.queue_ticker_idle_period,
                                                       false)
                                         else coalesce((t.tick_id is null or now() - t.tick_time >= p_overdue)
                                                       and s.seq > coalesce(t.tick_event_seq, 0), false)
                                    end as sure,
                                    coalesce(case when p_overdue is null
                                                  then not t.tick_settled or d.due
                                                  else (t.tick_id is null or now() - t.tick_time >= p_overdue)
                                                       and (not t.tick_settled or d.due)
                                             end, false) as maybe) w
         order by q.queue_id;
end
$$;

-- pgque._settle_ready(queue_id, tick): whether the queue's tick may be marked
-- settled: every transaction it may have missed has ended (the oldest running
-- is past its tick_settle_xid) and, in the same snapshot, none left an event
-- it did not cover or a delayed event due that it did not move. Reads only,
-- and neither waits nor fails, as _tick_wanted_nowait: the caller holds
-- sequence locks that a drop_queue waits for (_ticker_look), so a lock held
-- by a drop is waited for at most 1 ms, and an error says no.
create or replace function pgque._settle_ready(p_queue_id integer, p_tick pgque.tick)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set lock_timeout = '1ms'
as $$
declare
    v_ready boolean;
begin
    begin
        -- (Due by the tick's time at least: a clock set back leaves it ahead.)
        v_ready := coalesce(pg_snapshot_xmin(pg_current_snapshot()) > p_tick.tick_settle_xid
                        and not pgque._uncovered_events(p_queue_id, p_tick.tick_snapshot)
                        and not (exists (select from pgque.delayed_event)
                                 and pgque._delayed_due(p_queue_id, p_tick,
                                                        greatest(clock_timestamp(), p_tick.tick_time))),
                        false);
        return v_ready;  -- (a statement of its own: see _seq_before)
    exception when others then
        null;  -- (a lock timeout left pending is raised here: see _seq_before)
    end;
    return false;
exception when lock_not_available then
    return false;
end
$$;

-- pgque._settle_tick(queue_id): marks the queue's last tick settled when it
-- may be (_settle_ready); returns whether it did. Waits for nothing: a tick
-- row locked elsewhere (another ticker settling it, a drop_queue deleting it)
-- is left for the next poll. Only in READ COMMITTED, and only after
-- _ticker_look in the same transaction: the rotations of the delayed events
-- and of the event tables copy rows and TRUNCATE, which an older snapshot
-- sees as empty; the look's locks on those tables keep a rotation from
-- committing until this transaction ends, and each statement here takes a
-- snapshot after any that committed before.
create or replace function pgque._settle_tick(p_queue_id integer)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick pgque.tick := pgque._last_tick(p_queue_id);
begin
    if current_setting('transaction_isolation') <> 'read committed'
       or v_tick.tick_id is null or v_tick.tick_settled or v_tick.tick_settle_xid is null
       or not pgque._settle_ready(p_queue_id, v_tick) then
        return false;
    end if;
    update pgque.tick t set tick_settled = true
      from (select l.tick_queue, l.tick_id, l.tick_part from pgque.tick l
             where l.tick_queue = v_tick.tick_queue and l.tick_id = v_tick.tick_id
               and l.tick_part = v_tick.tick_part and not l.tick_settled
               for no key update skip locked) k
     where t.tick_queue = k.tick_queue and t.tick_id = k.tick_id and t.tick_part = k.tick_part;
    return found;
end
$$;

-- pgque._ticker_some(overdue, after, max_queues, queues): _ticker for the
-- queues whose ids are above after (null: from the first) and in queues
-- (null: any), at most max_queues of them (null: every one), in id order.
-- Returns the ticks made, the id of the last queue it looked at, or null when
-- no queue is left after it (so that a poll of fewer queues than max_queues
-- is one call), and the ids of the queues it ticked. The look at the
-- chunk is one statement (_ticker_look); only the queues it names are looked
-- at again, one by one, and ticked (_tick_if_wanted), and the last ticks it
-- names settled (_settle_tick). It keeps a lock on each queue's sequence until
-- the transaction ends (and a probe, on an event table): a statement over
-- thousands of queues outgrows the server's lock table ("out of shared
-- memory"), so the tickers go through them a few hundred per statement
-- (pgque.ticker_some).
create or replace function pgque._ticker_some(p_overdue interval, p_after integer,
                                              p_max_queues integer, p_queues integer[],
                                              out ticks integer, out last_queue integer,
                                              out ticked integer[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    -- The positions are read before this transaction has an id, or useless
    -- for settling (see the top).
    v_fresh boolean := pg_current_xact_id_if_assigned() is null;
    v_ids integer[];
    v_seqs bigint[];
    v_wanted boolean[];
    v_sure boolean[];
    v_settle boolean[];
    v_count integer;
    v_looked boolean := false;
begin
    ticks := 0;
    ticked := '{}';
    begin
        begin
            select coalesce(array_agg(l.queue_id order by l.queue_id), '{}'),
                   array_agg(l.seq order by l.queue_id), array_agg(l.wanted order by l.queue_id),
                   array_agg(l.sure order by l.queue_id), array_agg(l.settle order by l.queue_id)
              into v_ids, v_seqs, v_wanted, v_sure, v_settle
              from pgque._ticker_look(p_overdue, p_after, p_max_queues, p_queues) l;
            v_looked := true;  -- (also a statement of its own: see _seq_before)
        exception when others then
            null;  -- (a lock timeout left pending is raised here: see _seq_before)
        end;
    exception when lock_not_available then
        null;
    end;
    if not v_looked then
        -- A queue being dropped, most likely: every queue of the chunk is
        -- looked at by itself, as _tick_if_wanted does without waiting.
        v_ids := array(select q.queue_id from pgque.queue q
                        where (p_after is null or q.queue_id > p_after)
                          and (p_queues is null or q.queue_id = any(p_queues))
                        order by q.queue_id limit p_max_queues + 1);
        v_seqs := null;
        v_wanted := array_fill(true, array[cardinality(v_ids)]);
        v_sure := null;
        v_settle := array_fill(false, array[cardinality(v_ids)]);
    end if;
    -- One queue more than asked: whether any is left after the chunk.
    v_count := cardinality(v_ids);
    if v_count > p_max_queues then
        v_count := p_max_queues;
        last_queue := v_ids[v_count];
    end if;
    for i in 1 .. v_count loop
        if v_wanted[i] then
            if pgque._tick_if_wanted(v_ids[i], p_overdue, false,
                                     case when v_fresh then v_seqs[i] end,
                                     coalesce(v_sure[i], false)) is not null then
                ticks := ticks + 1;
                ticked := ticked || v_ids[i];
                continue;
            end if;
        end if;
        if v_settle[i] then
            perform pgque._settle_tick(v_ids[i]);
        end if;
    end loop;
end
$$;

-- pgque.ticker_some(after, max_queues, overdue, queues): ticker() (overdue
-- null) or tick_overdue(overdue) for at most max_queues queues (at least 1,
-- else 22023) whose ids are above after (null: from the first) and in queues
-- (null: any), in id order; returns the ticks made, the last queue id looked
-- at, null when no queue is left after it: call it again with that id until
-- then, each call its own transaction, so that no transaction holds locks on
-- every queue's tables; and the ids of the queues it ticked (the Ticker polls
-- those that were busy lately more often than the others).
create or replace function pgque.ticker_some(p_after integer, p_max_queues integer,
                                             p_overdue interval default null,
                                             p_queues integer[] default null,
                                             out ticks integer, out last_queue integer,
                                             out ticked integer[])
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if p_max_queues is null or p_max_queues < 1 then
        raise exception using errcode = '22023', message = 'max_queues must be at least 1';
    end if;
    if p_overdue < interval '0' then
        raise exception using errcode = '22023', message = 'after must not be negative';
    end if;
    select s.ticks, s.last_queue, s.ticked into ticks, last_queue, ticked
      from pgque._ticker_some(p_overdue, p_after, p_max_queues, p_queues) s;
end
$$;

-- pgque.ticker(): ticks every queue whose thresholds ask for it; returns how
-- many ticks were made.
create or replace function pgque.ticker()
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
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
set jit = off
as $$
begin
    if p_after is null or p_after < interval '0' then
        raise exception using errcode = '22023', message = 'after must not be negative';
    end if;
    return pgque._ticker(p_after);
end
$$;
