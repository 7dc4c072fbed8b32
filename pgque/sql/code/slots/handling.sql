-- pgque: the record of handler calls, for `pgque verify` (info/verify.sql).
--
-- A Worker started with record=True writes, before it acks a piece of a
-- slot's batch, one row per handler call of that piece into pgque.handling:
-- the event, the slot, the epoch it was received under, the worker, when the
-- call started and ended (the worker's clock) and how it ended. Written before
-- the ack, in a transaction of its own: a worker that dies after the record
-- and before the ack has its events handled again (and recorded again), so an
-- acked event always has its record; a worker whose ack is refused (it lost
-- its slot) has its calls on record all the same, which is what shows an
-- overlap. The verifier reads the record against the log and the cursors.

-- pgque.start_recording(queue, consumer, slots): marks the group as recorded
-- from now on, unless it already is (then keeps the earlier start); returns
-- that start. The verifier checks the events sent since. PQ001, PQ002, PQ014,
-- PQ015, PQ020 as for a receive.
create or replace function pgque.start_recording(p_queue text, p_consumer text, p_slots integer)
returns timestamptz
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_group pgque.consumer_group;
    v_since timestamptz;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(pgque._queue_row(p_queue), p_consumer, p_slots);
    if v_group.cg_recorded_since is not null then
        return v_group.cg_recorded_since;  -- no write: a worker's every start asks
    end if;
    update pgque.consumer_group g set cg_recorded_since = coalesce(g.cg_recorded_since, now())
     where g.cg_id = v_group.cg_id
    returning g.cg_recorded_since into v_since;
    return v_since;
end
$$;

-- pgque.record_handling(queue, consumer, slots, worker, calls): appends the
-- handler calls of calls, a JSON array of arrays [slot, ev_id, batch, retry,
-- key, epoch, started, ended, outcome], to the group's record: the call of the
-- handler of event ev_id (of batch batch, received with retry count retry,
-- partition key key or null, under epoch epoch or null) in slot slot by the
-- worker named worker, from started to ended (seconds since 1970-01-01 UTC),
-- its outcome "ok" (returned), "failed" (raised: nacked) or "dead" (raised,
-- not retryable). Returns how many calls. Does not ask for the slots'
-- ownership: a worker that lost a slot records its calls too. A group whose
-- record was forgotten while its workers ran starts a new record here, as
-- start_recording would, so their calls from then on can be verified. Raises 22023
-- for calls that are not an array of such arrays (a value missing or null
-- where one is due, an unknown outcome, a call that ends before it starts) or
-- a worker name over 200 characters; 22P02 for a value of the wrong type;
-- PQ023 for a slot out of range, PQ002 for one the group lacks; PQ012 for a
-- key over 512 bytes; PQ001, PQ014, PQ015, PQ020 as for a receive. Nothing is
-- written then. (JSON, not an array per column: the client encodes it in
-- microseconds, where psycopg's adapting of nine arrays took longer than the
-- insert.)
create or replace function pgque.record_handling(
    p_queue text, p_consumer text, p_slots integer, p_worker text, p_calls jsonb)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_subs integer[];  -- the slots' subscriptions, by slot + 1
    v_bad record;
    v_written integer;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    if p_worker is null or length(p_worker) > 200 then
        raise exception using errcode = '22023',
            message = 'record_handling: the worker name must be given, at most 200 characters';
    end if;
    if v_group.cg_recorded_since is null then  -- forgotten meanwhile (rare: one update)
        update pgque.consumer_group g set cg_recorded_since = coalesce(g.cg_recorded_since, now())
         where g.cg_id = v_group.cg_id;
    end if;
    if jsonb_typeof(p_calls) is distinct from 'array' then
        raise exception using errcode = '22023',
            message = 'record_handling: calls must be a JSON array of arrays of nine values';
    end if;
    v_subs := array(select s.sub_id from generate_series(0, v_group.cg_slots - 1) k
                      -- _slot_name, written out (as in _slot_subs)
                      left join pgque.subscription s
                        on s.sub_queue = v_queue.queue_id
                       and s.sub_consumer = v_group.cg_consumer || '#' || k::text || '/'
                                            || v_group.cg_slots::text
                     order by k);
    -- The calls in one statement: a call that is not one (a null, an unknown
    -- outcome, a slot out of range or missing, an end before its start, a
    -- key too long) breaks a constraint of the table, and a second look then
    -- finds which, for the message.
    begin
        insert into pgque.handling (hd_sub, hd_ev_id, hd_batch, hd_retry, hd_key, hd_epoch,
                                    hd_worker, hd_started, hd_ended, hd_outcome)
        select v_subs[r.slot + 1], r.ev_id, r.batch, r.retry, r.key, r.epoch, p_worker,
               r.started, r.ended,
               case r.outcome when 'ok' then 'o' when 'failed' then 'f' when 'dead' then 'd'
               end::"char"
          from pgque._handling_calls(p_calls) r;
        get diagnostics v_written = row_count;
    exception when not_null_violation or check_violation then
        select r.i, r.slot, r.key into v_bad
          from pgque._handling_calls(p_calls) r
         where r.slot is not null
           and (r.slot < 0 or r.slot >= v_group.cg_slots or v_subs[r.slot + 1] is null
                or octet_length(r.key) > 512)
         order by r.i limit 1;
        if v_bad.i is not null then
            perform pgque._check_slot(v_bad.slot, v_group.cg_slots);  -- PQ023
            perform pgque._check_keys(array[v_bad.key]);  -- PQ012
            raise exception using errcode = 'PQ002',
                message = format('consumer group %L of queue %L has no slot %s',
                                 pgque._name_for_message(p_consumer), v_queue.queue_name,
                                 v_bad.slot);
        end if;
        raise exception using errcode = '22023',
            message = 'record_handling: a call has a null, ends before it starts, '
                      'or has an outcome other than ok, failed or dead';
    end;
    return v_written;
end
$$;

-- pgque._handling_calls(calls): the calls of record_handling's JSON as rows,
-- numbered from 1 (i); a call that is not an array of nine values has a null
-- slot, and a time that is not a finite number of seconds within some 30,000
-- years of 1970 (NaN, Infinity) is null (record_handling refuses nulls).
create or replace function pgque._handling_calls(p_calls jsonb)
returns table (i bigint, slot integer, ev_id bigint, batch bigint, retry integer, key text,
               epoch bigint, started timestamptz, ended timestamptz, outcome text)
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select c.i, case when pg_catalog.jsonb_array_length(c.v) = 9 then (c.v->>0)::integer end, (c.v->>1)::bigint, (c.v->>2)::bigint, (c.v->>3)::integer,
           c.v->>4, (c.v->>5)::bigint,
           case when t.started > -1e12 and t.started < 1e12
                then pg_catalog.to_timestamp(t.started) end,
           case when t.ended > -1e12 and t.ended < 1e12
                then pg_catalog.to_timestamp(t.ended) end,
           c.v->>8
      from pg_catalog.jsonb_array_elements(p_calls) with ordinality as c(v, i)
     cross join lateral (select (c.v->>6)::float8 as started, (c.v->>7)::float8 as ended) t
$$;

-- pgque.forget_handling(queue, consumer, slots): deletes the group's record
-- and its start (the next start_recording begins anew); returns how many
-- calls it deleted. Errors as start_recording's.
create or replace function pgque.forget_handling(p_queue text, p_consumer text, p_slots integer)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v_deleted bigint;
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    delete from pgque.handling h
     where h.hd_sub = any(array(select g.sub_id from pgque._group_subs(v_group) g));
    get diagnostics v_deleted = row_count;
    update pgque.consumer_group set cg_recorded_since = null
     where cg_id = v_group.cg_id and cg_recorded_since is not null;
    return v_deleted;
end
$$;
