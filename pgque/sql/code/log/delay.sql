-- pgque: delayed events, moved into the log by the tick that passes their time.
--
-- A delayed send writes its event into pgque.delayed_event instead of the
-- log, under an id from the queue's event sequence that it returns. Ticks move them: each tick k of a
-- queue, made at time T(k) (its tick_time) with snapshot S(k), moves the
-- delayed events of the queue that S(k) sees and that are due by T(k), except
-- those the tick before already moved: those that S(k-1) saw and that were
-- due by T(k-1). By induction every event is moved once, by the first tick
-- that both sees it and has passed its time, and nothing marks a row moved:
-- the ticks are the record. The move runs in the tick's own transaction,
-- after the tick row, so the tick holds every event committed before it, and
-- the moved events get new ids from the queue's sequence, in due-time order,
-- after every id taken before: a delayed event enters its key's order when it falls due, as
-- if sent then (a batch, which may span several ticks, is read in id order).
-- Its ev_time is the tick's time, when it became ready; ev_delayed_id keeps
-- the id its send returned.
--
-- T(k) is the clock when the tick row is written, never less than T(k-1), so
-- no event enters the log before its time; ticks of a queue are serialized
-- (tick.sql), so T and S only grow. The ticker ticks a queue as soon as one of
-- its delayed events is due and not moved (_delayed_due), so an event falls
-- due within a ticker poll of its time, and is handed out at the tick after.
--
-- The rows stay until their partition is emptied (rotation.sql,
-- _rotate_delayed), which copies the rows not moved yet into the other one
-- as they are, transaction id included, while it holds their queues' tick
-- locks: the next tick judges the copies as the last one did the rows.

-- pgque._max_delay(): how far ahead an event may be sent, at most.
create or replace function pgque._max_delay()
returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select interval '30 days' $$;

-- pgque._due_times(count, deliver_ats, deliver_afters, now): the due time of
-- each of count events being sent at now, from its deliver_at or now plus its
-- deliver_after (either array may be null, or hold nulls: no delay); null for
-- an event to enter the log at once: no delay, or a due time not after now.
-- Raises 22023 when an event has both or an array's length is not count, and
-- PQ031 for a negative or infinite delay, or a due time more than _max_delay
-- ahead.
create or replace function pgque._due_times(p_count integer, p_deliver_ats timestamptz[],
                                            p_deliver_afters interval[], p_now timestamptz)
returns timestamptz[]
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_dues timestamptz[] := '{}';
    v_at timestamptz;
    v_after interval;
    v_due timestamptz;
    v_latest timestamptz := p_now + pgque._max_delay();
begin
    if p_deliver_ats is null and p_deliver_afters is null then
        return null;
    end if;
    -- Read by index below: one dimension, from 1, one element per event.
    if coalesce(cardinality(p_deliver_ats), p_count) <> p_count
       or coalesce(cardinality(p_deliver_afters), p_count) <> p_count
       or array_ndims(p_deliver_ats) > 1 or array_lower(p_deliver_ats, 1) <> 1
       or array_ndims(p_deliver_afters) > 1 or array_lower(p_deliver_afters, 1) <> 1 then
        raise exception using errcode = '22023',
            message = 'deliver_at and deliver_after must be one-dimensional arrays from 1, '
                      'with one element per event';
    end if;
    -- A loop over plain values: an event or a few per call, where a query
    -- over the arrays cost more than the send itself.
    for i in 1 .. p_count loop
        v_at := p_deliver_ats[i];
        v_after := p_deliver_afters[i];
        if v_at is not null and v_after is not null then
            raise exception using errcode = '22023',
                message = format('event %s has both deliver_at and deliver_after', i);
        elsif not isfinite(v_at) then
            raise exception using errcode = 'PQ031',
                message = format('event %s: deliver_at %s is not a finite time', i, v_at);
        elsif v_after < interval '0' then
            raise exception using errcode = 'PQ031',
                message = format('event %s: deliver_after %s is negative', i, v_after);
        end if;
        -- Compared before it is added: now plus a million years overflows.
        if v_after > pgque._max_delay() then
            v_due := 'infinity';
        else
            v_due := coalesce(v_at, p_now + v_after);
        end if;
        if v_due > v_latest then
            raise exception using errcode = 'PQ031',
                message = format('event %s: its due time %s is more than %s ahead',
                                 i, coalesce(v_at::text, format('now + %s', v_after)),
                                 pgque._max_delay()),
                hint = 'Delays go from 0 to 30 days; a due time in the past delivers at once.';
        end if;
        v_dues := v_dues || case when v_due > p_now then v_due end;
    end loop;
    return v_dues;
end
$$;

-- pgque._delayed_due(queue, last, upto): whether a delayed event of the queue
-- is due by upto and not moved by the tick last: one due since last's time,
-- or one that a transaction last did not see has sent. Reads only. The ticker
-- asks it of every queue at every poll (_tick_due, upto now), and a tick before
-- it moves anything (_make_tick, upto its time): each look is a bounded range
-- of one index (delayed_event_due, delayed_event_txid), so that the plan kept
-- for any queue is an index probe, even where another queue holds most of the
-- rows (an open-ended range let that plan scan the table), and an idle queue
-- pays a few cached probes. With since_only, the first look only: for a
-- caller that knows that no transaction last did not see can have sent one
-- (_tick_due: a settled tick, and no event id taken since it).
create or replace function pgque._delayed_due(p_queue_id integer, p_last pgque.tick,
                                              p_upto timestamptz,
                                              p_since_only boolean default false)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_txid xid8;
begin
    if exists (select from pgque.delayed_event d
                where d.de_queue = p_queue_id
                  and d.de_due > coalesce(p_last.tick_time, '-infinity')
                  and d.de_due <= p_upto) then
        return true;
    end if;
    if p_last.tick_id is null or p_since_only then
        return false;
    end if;
    -- Sent since last, by transactions committed now: ids up to this
    -- statement's snapshot.
    if exists (select from pgque.delayed_event d
                where d.de_queue = p_queue_id
                  and d.ev_txid >= pg_snapshot_xmax(p_last.tick_snapshot)
                  and d.ev_txid < pg_snapshot_xmax(pg_current_snapshot())
                  and d.de_due <= p_upto) then
        return true;
    end if;
    -- And by those in progress then, one probe each (a list of unknown length
    -- in one look gets a plan that scans).
    for v_txid in select pg_snapshot_xip(p_last.tick_snapshot) loop
        if exists (select from pgque.delayed_event d
                    where d.de_queue = p_queue_id and d.ev_txid = v_txid
                      and d.de_due <= p_upto) then
            return true;
        end if;
    end loop;
    return false;
end
$$;

-- pgque._move_delayed(queue, prev, tick): moves into the queue's current
-- event table the delayed events tick moves (see the top of this file): those
-- its snapshot sees, due by its time, and not moved by prev, the queue's tick
-- before (null: none). Returns how many. Runs in tick's transaction, after
-- tick was written.
create or replace function pgque._move_delayed(p_queue pgque.queue, p_prev pgque.tick,
                                               p_tick pgque.tick)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    -- New ids, from the insert's default in this order (by due time: as if
    -- each were sent when due; then as sent): the log's order.
    execute format(
        'insert into pgque.%I (ev_time, ev_type, ev_data, ev_extra1, ev_delayed_id)'
        ' select $2, d.ev_type, d.ev_data, d.ev_extra1, d.ev_id'
        '   from (select d.* from pgque.delayed_event d'
        '          where d.de_queue = $1 and d.de_due <= $2'
        '            and ($3 is null or d.de_due > $3)'
        '         union all'
        '         select d.* from pgque.delayed_event d'
        '          where d.de_queue = $1 and d.ev_txid >= $4 and d.de_due <= $3'
        '         union all'
        '         select d.* from pgque.delayed_event d'
        '          where d.de_queue = $1 and d.ev_txid = any($5) and d.de_due <= $3'
        '            and d.ev_txid < $4) d'
        '  where pg_visible_in_snapshot(d.ev_txid, $6)'
        '  order by d.de_due, d.ev_id',
        pgque._event_table(p_queue.queue_id, p_queue.queue_cur_table))
      using p_queue.queue_id, p_tick.tick_time, p_prev.tick_time,
            pg_snapshot_xmax(p_prev.tick_snapshot),
            array(select pg_snapshot_xip(p_prev.tick_snapshot)), p_tick.tick_snapshot;
    get diagnostics v_count = row_count;
    if v_count > 0 and p_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(p_queue.queue_id);  -- the tick after, at once (ticker/sleep.sql)
    end if;
    return v_count;
end
$$;

-- pgque._delayed_waiting(queue_id): the queue's delayed events not moved into
-- the log yet, as of its newest tick: how many, and the earliest due time.
-- Reads every such row: for status, not for a hot path.
create or replace function pgque._delayed_waiting(p_queue_id integer,
                                                  out waiting bigint, out next_due timestamptz)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with last as (select * from pgque._last_tick(p_queue_id))
    select count(*), min(d.de_due)
      from pgque.delayed_event d, last l
     where d.de_queue = p_queue_id
       and not coalesce(d.de_due <= l.tick_time
                        and pg_visible_in_snapshot(d.ev_txid, l.tick_snapshot), false)
$$;
