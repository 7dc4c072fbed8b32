-- pgque: subscriptions (a consumer's cursor over a queue).
--
-- Every subscription sees every event of its queue (fan-out); consumers never
-- block each other. A new subscription starts at the queue's newest tick, so
-- it receives the events committed after that tick.

-- pgque._subscribe(queue, consumer): registers the subscription unless it
-- exists; returns true when it was created. Takes the name as given (callers
-- validate it).
create or replace function pgque._subscribe(p_queue pgque.queue, p_consumer text)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick bigint := (pgque._last_tick(p_queue.queue_id)).tick_id;
begin
    if v_tick is null then
        v_tick := pgque._tick(p_queue);
    end if;
    insert into pgque.subscription (sub_queue, sub_consumer, sub_last_tick)
    values (p_queue.queue_id, p_consumer, v_tick)
    on conflict (sub_queue, sub_consumer) do nothing;
    return found;
end
$$;

-- pgque.subscribe(queue, consumer): subscribes a consumer; returns true when
-- the subscription is new, false when it already existed (nothing changes).
-- Raises PQ001 (unknown queue) or PQ004 (invalid consumer name).
create or replace function pgque.subscribe(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pgque._check_name('consumer', p_consumer);
    return pgque._subscribe(pgque._queue(p_queue), p_consumer);
end
$$;

-- pgque.unsubscribe(queue, consumer): removes a subscription with its open
-- batch and pending retries; it no longer holds back rotation. Returns false
-- when there was no such subscription. Dead letters are kept.
create or replace function pgque.unsubscribe(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue(p_queue);
begin
    if position('#' in p_consumer) > 0 then
        raise exception using errcode = 'PQ021',
            message = format('%L is a slot subscription; use unsubscribe_slots', p_consumer);
    end if;
    delete from pgque.subscription where sub_queue = v_queue.queue_id and sub_consumer = p_consumer;
    return found;
end
$$;
