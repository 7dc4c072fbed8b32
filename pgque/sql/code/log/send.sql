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

-- pgque._event_insert(queue_id, table, values): the INSERT of one event
-- into event table `table` of the queue, as SQL text: its type, payload and
-- partition key from the three expressions values, returning its ev_id. The
-- one spelling of a sent event's columns, for the event writer (static) and
-- send (dynamic, for a table the writer does not hold); send_batch adds
-- ev_id to them. values is pgque's own text, never a caller's.
create or replace function pgque._event_insert(p_queue_id integer, p_table integer,
                                               p_values text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format('insert into pgque.%I (%s) values (%s) returning ev_id',
                  pgque._event_table(p_queue_id, p_table), pgque._sent_columns(), p_values)
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
    v_id := pgque._write_event(v_queue.queue_id, v_queue.queue_cur_table, p_type, p_payload,
                               p_partition_key);
    if v_id is null then
        -- A table the writer does not know (generated/event_writer.sql): the same
        -- INSERT, planned here.
        execute pgque._event_insert(v_queue.queue_id, v_queue.queue_cur_table, '$1, $2, $3')
           into v_id
          using p_type, p_payload, p_partition_key;
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
    v_ids := array(select nextval(v_queue.queue_event_seq)
                     from generate_series(1, cardinality(p_types)) order by 1);
    execute format('insert into pgque.%I (ev_id, %s) select * from unnest($1, $2, $3, $4)',
                   pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table),
                   pgque._sent_columns())
      using v_ids, p_types, p_payloads,
            coalesce(p_partition_keys, array_fill(null::text, array[cardinality(p_types)]));
    return v_ids;
end
$$;
