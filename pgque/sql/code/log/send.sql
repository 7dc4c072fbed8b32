-- pgque: producing events.
--
-- Events are only ever INSERTed, into the queue's current event table, in the
-- caller's transaction: an event exists for consumers only if that
-- transaction commits. The partition key is stored in ev_extra1.

-- pgque._check_payloads(payloads): raises PQ005 unless every element is JSON
-- text (SQL NULL is allowed and means "no payload"). Validates without
-- writing, so the exception block costs no subtransaction id.
create or replace function pgque._check_payloads(p_payloads text[])
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_i integer;
begin
    begin
        perform p::json from unnest(p_payloads) p;
    exception when invalid_text_representation then
        -- Find the culprit for the message; this is the slow, rare path.
        for v_i in 1 .. coalesce(cardinality(p_payloads), 0) loop
            begin
                perform p_payloads[v_i]::json;
            exception when invalid_text_representation then
                raise exception using errcode = 'PQ005',
                    message = format('payload %s is not valid JSON: %s', v_i, sqlerrm);
            end;
        end loop;
    end;
end
$$;

-- pgque._check_keys(keys): raises PQ012 if a partition key is longer than
-- 512 bytes (a key is an identifier, not data).
create or replace function pgque._check_keys(p_keys text[])
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_too_long integer;
begin
    select i into v_too_long
      from unnest(p_keys) with ordinality as k(key, i)
     where octet_length(k.key) > 512
     limit 1;
    if v_too_long is not null then
        raise exception using errcode = 'PQ012',
            message = format('partition key %s is longer than 512 bytes', v_too_long);
    end if;
end
$$;

-- pgque._event_insert(queue_id, table, id, values): the INSERT of one event
-- into event table `table` of the queue, as SQL text: its ev_id from the
-- expression id, its type, payload and partition key from the three
-- expressions values, returning its ev_id. The one spelling of a sent event's
-- columns, for the event writer (static) and send (dynamic, for a table the
-- writer does not hold); send_batch adds ev_id to them. id and values are
-- pgque's own text, never a caller's.
create or replace function pgque._event_insert(p_queue_id integer, p_table integer,
                                               p_id text, p_values text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('insert into pgque.%I (ev_id, %s) values (%s, %s) returning ev_id',
                  pgque._event_table(p_queue_id, p_table), pgque._sent_columns(), p_id, p_values)
$$;

-- pgque._sent_columns(): the columns a sent event gives, in the order of
-- send's arguments; the others (ev_id, ev_time, ev_txid, ev_owner, ev_retry)
-- take their defaults.
create or replace function pgque._sent_columns()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'ev_type, ev_data, ev_extra1' $$;

-- pgque.send(queue, type, payload, partition_key): appends one event to the
-- queue's log in the caller's transaction and returns its ev_id.
-- Raises PQ001 (unknown queue), PQ005 (payload not JSON), PQ012 (key too long),
-- PQ015 (the queue's 'send' grants leave the caller out).
--
-- The hot path of every producer: it inserts through the event writer
-- (generated/event_writer.sql), which plans nothing, and checks its one payload
-- itself, with _check_payloads' error: building the array and calling that
-- helper cost 3 µs of the 20 this function took in a loop.
create or replace function pgque.send(
    p_queue text, p_type text, p_payload text, p_partition_key text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_id bigint;
begin
    -- _queue_row's lookup, written out: the nested call with its own
    -- search_path cost 7 µs of a one-event transaction; its error stays there.
    select * into v_queue from pgque.queue where queue_name = p_queue;
    if not found then
        perform pgque._queue_row(p_queue);
    end if;
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    begin
        perform p_payload::json;
    exception when invalid_text_representation then
        raise exception using errcode = 'PQ005',
            message = format('payload 1 is not valid JSON: %s', sqlerrm);
    end;
    if octet_length(p_partition_key) > 512 then
        perform pgque._check_keys(array[p_partition_key]);
    end if;
    perform pg_current_xact_id();  -- before the event id (log/tick.sql, "Settled ticks")
    v_id := pgque._write_event(v_queue.queue_id, v_queue.queue_cur_table, p_type, p_payload,
                               p_partition_key, null);
    if v_id is null then
        -- A table the writer does not know (generated/event_writer.sql): the same
        -- INSERT, planned here.
        execute pgque._event_insert(v_queue.queue_id, v_queue.queue_cur_table, 'default',
                                    '$1, $2, $3')
           into v_id
          using p_type, p_payload, p_partition_key;
    end if;
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);  -- at commit (ticker/sleep.sql)
    end if;
    return v_id;
end
$$;

-- pgque.send(queue, type, payload jsonb, partition_key): the same for a jsonb
-- payload.
create or replace function pgque.send(
    p_queue text, p_type text, p_payload jsonb, p_partition_key text default null)
returns bigint
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque.send(p_queue, p_type, p_payload::text, p_partition_key) $$;

-- pgque.send_batch(queue, types, payloads, partition_keys): appends several
-- events in one statement, in array order, and returns their ev_ids in the
-- same order. The arrays must have equal lengths; partition_keys may be null
-- (no keys). Nothing is inserted if any element is invalid.
create or replace function pgque.send_batch(
    p_queue text, p_types text[], p_payloads text[], p_partition_keys text[] default null)
returns bigint[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_ids bigint[];
begin
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    if coalesce(cardinality(p_types), 0) <> coalesce(cardinality(p_payloads), 0)
       or (p_partition_keys is not null
           and cardinality(p_partition_keys) <> coalesce(cardinality(p_types), 0)) then
        raise exception using errcode = '22023',
            message = 'send_batch: types, payloads and partition keys must have the same length';
    end if;
    if coalesce(cardinality(p_types), 0) = 0 then
        return '{}';
    end if;
    perform pgque._check_payloads(p_payloads);
    perform pgque._check_keys(p_partition_keys);
    -- The ids first, sorted, then the i-th event gets the i-th: ev_ids follow
    -- the array order whatever order nextval ran in, and the insert needs
    -- neither a sort of the rows nor RETURNING (together 13% of the call).
    perform pg_current_xact_id();  -- before the event ids (log/tick.sql, "Settled ticks")
    v_ids := array(select nextval(v_queue.queue_event_seq)
                     from generate_series(1, cardinality(p_types)) order by 1);
    execute format('insert into pgque.%I (ev_id, %s) select * from unnest($1, $2, $3, $4)',
                   pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table),
                   pgque._sent_columns())
      using v_ids, p_types, p_payloads,
            coalesce(p_partition_keys, array_fill(null::text, array[cardinality(p_types)]));
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return v_ids;
end
$$;

-- What a send with options did with one event: its id (the id it has, or will
-- have, in the log), whether it was a duplicate of an earlier send of its
-- idempotency key (nothing written, the earlier event's id), and the time it
-- enters the log when delayed (else null).
create type pgque.sent_event as (
    event_id   bigint,
    duplicate  boolean,
    deliver_at timestamptz
);

-- pgque._send_events(queue, types, payloads, partition_keys, deliver_ats,
-- deliver_afters, idempotency_keys): send_batch with a due time and an
-- idempotency key per event (each array null, or holding nulls, for none),
-- in the caller's transaction. Returns one row per event, in array order.
-- Ids follow the array order. An event due now or earlier enters the log at
-- once; a later one waits in pgque.delayed_event (delay.sql). An event whose
-- idempotency key was sent within the queue's window, or earlier in the
-- arrays, is not written (idempotency.sql). Nothing is written if any element
-- is invalid: 22023 for arrays of other lengths or both kinds of delay, PQ005,
-- PQ012, PQ031 (delay), PQ032 (idempotency key), PQ001, PQ015 as for send.
create or replace function pgque._send_events(
    p_queue text, p_types text[], p_payloads text[], p_partition_keys text[],
    p_deliver_ats timestamptz[], p_deliver_afters interval[], p_idempotency_keys text[])
returns setof pgque.sent_event
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_count integer := coalesce(cardinality(p_types), 0);
    v_now timestamptz := clock_timestamp();
    v_dues timestamptz[];
    v_ids bigint[];
    v_duplicates boolean[];
    v_keys text[];
begin
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    if coalesce(cardinality(p_payloads), 0) <> v_count
       or coalesce(cardinality(p_partition_keys), v_count) <> v_count
       or coalesce(cardinality(p_idempotency_keys), v_count) <> v_count then
        raise exception using errcode = '22023',
            message = 'types, payloads, partition keys and idempotency keys must have the same length';
    end if;
    v_dues := pgque._due_times(v_count, p_deliver_ats, p_deliver_afters, v_now);
    if v_count = 0 then
        return;
    end if;
    perform pgque._check_payloads(p_payloads);
    perform pgque._check_keys(p_partition_keys);
    perform pgque._check_idempotency_keys(p_idempotency_keys);
    v_keys := coalesce(p_partition_keys, array_fill(null::text, array[v_count]));
    v_dues := coalesce(v_dues, array_fill(null::timestamptz, array[v_count]));
    -- The ids first, in array order (as send_batch), whether or not each
    -- event turns out to be sent: a duplicate's id is a gap in the sequence.
    perform pg_current_xact_id();  -- before the event ids (log/tick.sql, "Settled ticks")
    v_ids := array(select nextval(v_queue.queue_event_seq)
                     from generate_series(1, v_count) order by 1);
    v_duplicates := array_fill(false, array[v_count]);
    if exists (select from unnest(p_idempotency_keys) k where k is not null) then
        select c.ids, c.duplicates, c.dues into v_ids, v_duplicates, v_dues
          from pgque._claim_idempotency_keys(v_queue, p_idempotency_keys, v_ids, v_dues,
                                             v_now) c;
    end if;
    execute format('insert into pgque.%I (ev_id, %s)'
                   ' select e.id, e.type, e.data, e.key'
                   '   from unnest($1, $2, $3, $4, $5, $6) as e(id, type, data, key, due, dup)'
                   '  where e.due is null and not e.dup',
                   pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table),
                   pgque._sent_columns())
      using v_ids, p_types, p_payloads, v_keys, v_dues, v_duplicates;
    insert into pgque.delayed_event (de_queue, de_due, ev_id, ev_time, ev_type, ev_data,
                                     ev_extra1, de_part)
    select v_queue.queue_id, e.due, e.id, now(), e.type, e.data, e.key,
           (select r.rt_part from pgque.rotation r where r.rt_name = 'delayed')
      from unnest(v_ids, p_types, p_payloads, v_keys, v_dues, v_duplicates)
           as e(id, type, data, key, due, dup)
     where e.due is not null and not e.dup;
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return query select i.id, i.dup, i.due
                   from unnest(v_ids, v_duplicates, v_dues) with ordinality as i(id, dup, due, n)
                  order by i.n;
end
$$;

-- pgque.send_with(queue, type, payload, partition_key, deliver_at,
-- deliver_after, idempotency_key): send with options, returning what it did
-- (pgque.sent_event). deliver_at (a time) or deliver_after (an interval from
-- now, by the database's clock) delays the event: it enters the log when it
-- falls due, as if sent then, and is never handed out earlier; a time not in
-- the future sends at once; more than 30 days ahead raises PQ031. With
-- idempotency_key (1 to 512 bytes, else PQ032), a send of a key already sent
-- within the queue's idempotency window writes nothing and returns the first
-- event's id, with duplicate true. Other errors as for send, and 22023 for
-- both delays. One event's path of _send_events, written out: no arrays, and
-- every statement static (a delayed send, a key) or send's own (neither).
create or replace function pgque.send_with(
    p_queue text, p_type text, p_payload text, p_partition_key text default null,
    p_deliver_at timestamptz default null, p_deliver_after interval default null,
    p_idempotency_key text default null)
returns pgque.sent_event
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_now timestamptz := clock_timestamp();
    v_due timestamptz;
    v_claim record;
    v_id bigint;
begin
    if p_deliver_at is not null or p_deliver_after is not null then
        v_due := (pgque._due_times(1, array[p_deliver_at], array[p_deliver_after], v_now))[1];
    end if;
    if v_due is null and p_idempotency_key is null then
        -- No delay after all, no key: send's own path, its checks included.
        return row(pgque.send(p_queue, p_type, p_payload, p_partition_key), false,
                   null::timestamptz);
    end if;
    select * into v_queue from pgque.queue where queue_name = p_queue;
    if not found then
        perform pgque._queue_row(p_queue);
    end if;
    if v_queue.queue_senders is not null then
        perform pgque._require_queue(v_queue, 'send');
    end if;
    begin
        perform p_payload::json;
    exception when invalid_text_representation then
        raise exception using errcode = 'PQ005',
            message = format('payload 1 is not valid JSON: %s', sqlerrm);
    end;
    if octet_length(p_partition_key) > 512 then
        perform pgque._check_keys(array[p_partition_key]);
    end if;
    perform pgque._check_idempotency_keys(array[p_idempotency_key]);
    perform pg_current_xact_id();  -- before the event id (log/tick.sql, "Settled ticks")
    v_id := nextval(v_queue.queue_event_seq);
    if p_idempotency_key is not null then
        v_claim := pgque._claim_idempotency_key(v_queue, pgque._idempotency_part(),
                                                p_idempotency_key, v_id, v_due, v_now);
        if v_claim.duplicate then
            return row(v_claim.event_id, true, v_claim.due);  -- v_id: a gap in the sequence
        end if;
    end if;
    if v_due is not null then
        insert into pgque.delayed_event (de_queue, de_due, ev_id, ev_time, ev_type, ev_data,
                                         ev_extra1, de_part)
        values (v_queue.queue_id, v_due, v_id, now(), p_type, p_payload, p_partition_key,
                (select r.rt_part from pgque.rotation r where r.rt_name = 'delayed'));
    elsif pgque._write_event(v_queue.queue_id, v_queue.queue_cur_table, p_type, p_payload,
                             p_partition_key, v_id) is null then
        -- A table the writer does not know (generated/event_writer.sql).
        execute pgque._event_insert(v_queue.queue_id, v_queue.queue_cur_table, '$4',
                                    '$1, $2, $3')
          using p_type, p_payload, p_partition_key, v_id;
    end if;
    if v_queue.queue_ticker_asleep then
        perform pgque._wake_ticker(v_queue.queue_id);
    end if;
    return row(v_id, false, v_due);
end
$$;

-- pgque.send_batch_with(queue, types, payloads, partition_keys, deliver_ats,
-- deliver_afters, idempotency_keys): send_batch with options per event (any
-- array null for none), one pgque.sent_event per event in array order. A
-- batch may repeat a key: its first event is sent, the later ones are
-- duplicates of it. Nothing is written if any element is invalid.
create or replace function pgque.send_batch_with(
    p_queue text, p_types text[], p_payloads text[], p_partition_keys text[] default null,
    p_deliver_ats timestamptz[] default null, p_deliver_afters interval[] default null,
    p_idempotency_keys text[] default null)
returns setof pgque.sent_event
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select s.* from pgque._send_events(p_queue, p_types, p_payloads, p_partition_keys,
                                       p_deliver_ats, p_deliver_afters, p_idempotency_keys) s
$$;
