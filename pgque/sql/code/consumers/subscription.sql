-- pgque: subscriptions (a consumer's cursor over a queue).
--
-- Every subscription sees every event of its queue (fan-out); consumers never
-- block each other. A new subscription starts at the queue's newest tick, so
-- it receives the events committed after that tick.

-- pgque._subscribe(queue, consumer, owner): registers the subscription
-- unless it exists; returns true when it was created. Takes the name as given
-- (callers validate it). A plain consumer gets owner; a slot subscription
-- (its name holds '#') belongs to its group instead and gets the random key
-- of the session lock that owns it.
create or replace function pgque._subscribe(p_queue pgque.queue, p_consumer text,
                                            p_owner oid default null)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick bigint := (pgque._last_tick(p_queue.queue_id)).tick_id;
    v_slot boolean := position('#' in p_consumer) > 0;
    v_sub_id integer;
begin
    if v_tick is null then
        v_tick := pgque._make_tick(p_queue);
    end if;
    insert into pgque.subscription (sub_queue, sub_consumer, sub_owner, sub_lock_key)
    values (p_queue.queue_id, p_consumer, case when not v_slot then p_owner end,
            case when v_slot then pgque._random_key() end)
    on conflict (sub_queue, sub_consumer) do nothing
    returning sub_id into v_sub_id;
    if v_sub_id is null then
        return false;
    end if;
    -- Its first cursor, with the rotation row held FOR SHARE until this
    -- commits: no rotation copies the cursors before this one is seen.
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_part)
    values (v_sub_id, 1, v_tick, pgque._write_part('cursor', true));
    return true;
end
$$;

-- pgque.subscribe(queue, consumer): subscribes a consumer, owned by the
-- calling role; returns true when the subscription is new, false when it
-- already existed (nothing changes). Raises PQ001 (unknown queue), PQ004
-- (invalid consumer name), PQ015 (the queue's 'consume' grants leave the
-- caller out) or PQ014 (the consumer exists and belongs to another role).
create or replace function pgque.subscribe(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_sub pgque.subscription;
begin
    perform pgque._check_name('consumer', p_consumer);
    v_queue := pgque._queue_row(p_queue);
    perform pgque._require_queue(v_queue, 'consume');
    if pgque._subscribe(v_queue, p_consumer, pgque._role_id(pgque._caller())) then
        return true;
    end if;
    select * into v_sub from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = p_consumer;
    perform pgque._require_consumer(v_queue, v_sub.sub_owner, v_sub.sub_grantees, p_consumer);
    return false;
end
$$;

-- pgque._unsubscribe(queue_id, consumers): deletes the subscriptions (retries
-- go by cascade) and their record of handler calls (slots/handling.sql);
-- returns how many. Their cursor rows stay until the next rotations empty
-- their partitions (no row of the cursor log is deleted).
create or replace function pgque._unsubscribe(p_queue_id integer, p_consumers text[])
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_ids integer[];
begin
    with gone as (
        delete from pgque.subscription
         where sub_queue = p_queue_id and sub_consumer = any(p_consumers)
        returning sub_id)
    select array_agg(sub_id) into v_ids from gone;
    delete from pgque.handling where hd_sub = any(v_ids);
    return coalesce(cardinality(v_ids), 0);
end
$$;

-- pgque.unsubscribe(queue, consumer): removes a subscription with its open
-- batch and pending retries; it no longer holds back rotation. Returns false
-- when there was no such subscription. Dead letters are kept. Raises PQ014
-- when the consumer belongs to another role.
create or replace function pgque.unsubscribe(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_sub pgque.subscription;
begin
    if position('#' in p_consumer) > 0 then
        raise exception using errcode = 'PQ021',
            message = format('%L is a slot subscription; use unsubscribe_slots',
                             pgque._name_for_message(p_consumer));
    end if;
    select * into v_sub from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = p_consumer;
    if not found then
        return false;
    end if;
    perform pgque._require_consumer(v_queue, v_sub.sub_owner, v_sub.sub_grantees, p_consumer);
    return pgque._unsubscribe(v_queue.queue_id, array[p_consumer]) > 0;
end
$$;
