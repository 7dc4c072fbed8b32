-- pgque: creating, configuring and dropping queues.

-- pgque._interval(key, value): a configuration value as an interval. Numbers
-- are seconds; strings are PostgreSQL interval literals. PQ007 otherwise.
create or replace function pgque._interval(p_key text, p_value jsonb)
returns interval
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_result interval;
begin
    begin
        if jsonb_typeof(p_value) = 'number' then
            v_result := make_interval(secs => (p_value #>> '{}')::double precision);
        elsif jsonb_typeof(p_value) = 'string' then
            v_result := (p_value #>> '{}')::interval;
        end if;
    exception when others then
        v_result := null;
    end;
    -- isfinite: PostgreSQL 17 has infinite intervals; a setting must be finite.
    if v_result is null or v_result < interval '0' or not isfinite(v_result) then
        raise exception using errcode = 'PQ007',
            message = format('%s must be a finite non-negative interval (seconds or an interval literal), not %s',
                             pgque._name_for_message(p_key), pgque._name_for_message(p_value::text));
    end if;
    return v_result;
end
$$;

-- pgque._integer(key, value, min, max): a configuration value as an integer
-- within [min, max]. PQ007 otherwise.
create or replace function pgque._integer(p_key text, p_value jsonb, p_min integer, p_max integer)
returns integer
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_result integer;
begin
    if jsonb_typeof(p_value) = 'number' and (p_value #>> '{}') ~ '^[0-9]+$'
       and length(p_value #>> '{}') <= 9 then
        v_result := (p_value #>> '{}')::integer;
    end if;
    if v_result is null or v_result < p_min or v_result > p_max then
        raise exception using errcode = 'PQ007',
            message = format('%s must be an integer from %s to %s, not %s', pgque._name_for_message(p_key),
                             p_min, p_max, pgque._name_for_message(p_value::text));
    end if;
    return v_result;
end
$$;

-- pgque._configure(queue, config, creating): the queue row with the settings
-- of config applied. Known keys: ticker_max_count, ticker_max_lag,
-- ticker_idle_period, rotation_period, max_retries, idempotency_window, and
-- (only when creating) event_tables. Unknown keys and bad values raise PQ007.
create or replace function pgque._configure(p_queue pgque.queue, p_config jsonb, p_creating boolean)
returns pgque.queue
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key text;
    v_value jsonb;
begin
    if p_config is null or jsonb_typeof(p_config) <> 'object' then
        raise exception using errcode = 'PQ007', message = 'queue configuration must be a JSON object';
    end if;
    for v_key, v_value in select * from jsonb_each(p_config) loop
        case v_key
        when 'ticker_max_count' then
            p_queue.queue_ticker_max_count := pgque._integer(v_key, v_value, 1, 100000000);
        when 'ticker_max_lag' then
            p_queue.queue_ticker_max_lag := pgque._interval(v_key, v_value);
        when 'ticker_idle_period' then
            p_queue.queue_ticker_idle_period := pgque._interval(v_key, v_value);
        when 'rotation_period' then
            p_queue.queue_rotation_period := pgque._interval(v_key, v_value);
        when 'max_retries' then
            p_queue.queue_max_retries := pgque._integer(v_key, v_value, 0, 1000000);
        when 'idempotency_window' then
            p_queue.queue_idempotency_window := pgque._interval(v_key, v_value);
            if p_queue.queue_idempotency_window <= interval '0'
               or p_queue.queue_idempotency_window > interval '30 days' then
                raise exception using errcode = 'PQ007',
                    message = format('idempotency_window must be more than 0 and at most 30 days, not %s',
                                     pgque._name_for_message(v_value::text));
            end if;
        when 'event_tables' then
            if not p_creating then
                raise exception using errcode = 'PQ007',
                    message = 'event_tables can only be set when the queue is created';
            end if;
            p_queue.queue_ntables := pgque._integer(v_key, v_value, 2, 64);
        else
            raise exception using errcode = 'PQ007',
                message = format('unknown queue setting %L', pgque._name_for_message(v_key)),
                hint = 'Known settings: ticker_max_count, ticker_max_lag, ticker_idle_period, '
                       'rotation_period, max_retries, idempotency_window, event_tables.';
        end case;
    end loop;
    return p_queue;
end
$$;

-- pgque._store_config(queue): writes a queue row's settings back to its row.
create or replace function pgque._store_config(p_queue pgque.queue)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    update pgque.queue
       set queue_event_seq = p_queue.queue_event_seq,
           queue_ntables = p_queue.queue_ntables,
           queue_rotation_period = p_queue.queue_rotation_period,
           queue_ticker_max_count = p_queue.queue_ticker_max_count,
           queue_ticker_max_lag = p_queue.queue_ticker_max_lag,
           queue_ticker_idle_period = p_queue.queue_ticker_idle_period,
           queue_max_retries = p_queue.queue_max_retries,
           queue_idempotency_window = p_queue.queue_idempotency_window
     where queue_id = p_queue.queue_id
$$;

-- pgque._lock_queue(queue_id, purpose, wait): takes the queue's lock row of
-- purpose ('tick' or 'maint', see pgque.queue_lock) FOR UPDATE, until the end
-- of the transaction; true when this transaction now holds it. With wait it
-- waits for another holder; without, it gives up at once when the row is
-- locked. False also when the row is gone: the queue was dropped.
create or replace function pgque._lock_queue(p_queue_id integer, p_purpose text, p_wait boolean)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_wait then
        perform from pgque.queue_lock where ql_queue = p_queue_id and ql_purpose = p_purpose
            for update;
    else
        perform from pgque.queue_lock where ql_queue = p_queue_id and ql_purpose = p_purpose
            for update skip locked;
    end if;
    return found;
end
$$;

-- pgque.create_queue(queue, config, exist_ok): creates a queue with its event
-- tables, sequence, lock rows and first tick; returns the queue id. An
-- existing queue raises PQ006 unless exist_ok, in which case its id is
-- returned unchanged. Concurrent creators of one name need no lock of their
-- own: the insert of the queue row waits for another transaction's
-- uncommitted row of that name, and finds it once that one commits.
create or replace function pgque.create_queue(
    p_queue text, p_config jsonb default '{}', p_exist_ok boolean default false)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue;
    v_parent text;
    v_child text;
    v_seq text;
    n integer;
begin
    -- Not while an install replaces the code this runs on (and no install
    -- while queues are made): installs take this row FOR UPDATE.
    perform from pgque.install_lock for share;
    perform pgque._check_name('queue', p_queue);
    loop
        -- Looked up first, so that exist_ok on an existing queue writes nothing.
        select * into v_queue from pgque.queue where queue_name = p_queue;
        if found then
            if p_exist_ok then
                return v_queue.queue_id;
            end if;
            raise exception using errcode = 'PQ006', message = format('queue %L already exists',
                                                              pgque._name_for_message(p_queue));
        end if;
        -- Insert with the table's defaults first, then apply the caller's
        -- settings. A concurrent creator's row of the same name makes this
        -- wait for its transaction: when that commits, nothing is inserted
        -- and the lookup above finds its queue; when it rolls back, this
        -- insert goes ahead.
        insert into pgque.queue (queue_name, queue_event_seq)
        values (p_queue, 'pgque.tick_id_seq'::regclass)
        on conflict (queue_name) do nothing
        returning * into v_queue;
        exit when found;
    end loop;
    insert into pgque.queue_lock (ql_queue, ql_purpose)
    values (v_queue.queue_id, 'tick'), (v_queue.queue_id, 'maint');
    v_queue := pgque._configure(v_queue, p_config, true);

    v_parent := pgque._event_table(v_queue.queue_id);
    v_seq := v_parent || '_id_seq';
    execute format('create sequence pgque.%I', v_seq);
    execute format('create table pgque.%I (like pgque.event_template including defaults)', v_parent);
    execute format('alter table pgque.%I alter column ev_id set default nextval(%L), '
                   'alter column ev_time set default now(), '
                   'alter column ev_txid set default pg_current_xact_id()',
                   v_parent, 'pgque.' || v_seq);
    for n in 0 .. v_queue.queue_ntables - 1 loop
        v_child := pgque._event_table(v_queue.queue_id, n);
        execute format('create table pgque.%I () inherits (pgque.%I)', v_child, v_parent);
        execute format('create index %I on pgque.%I (ev_txid)', v_child || '_txid_idx', v_child);
        -- An explicit ACL, as the install's revoke gives every table: the same
        -- rights as the default, and the same catalog whichever made the queue.
        execute format('revoke all on pgque.%I from public', v_child);
    end loop;
    execute format('revoke all on pgque.%I, pgque.%I from public', v_parent, v_seq);

    v_queue.queue_event_seq := ('pgque.' || v_seq)::regclass;
    perform pgque._store_config(v_queue);
    perform pgque._sync_batch_reader(v_queue.queue_id, false);
    perform pgque._sync_event_writer(false);

    perform pgque._make_tick(v_queue, p_settled => true);  -- nothing sent yet, nor can be
    return v_queue.queue_id;
end
$$;

-- pgque.set_queue_config(queue, config): changes settings of an existing
-- queue (see _configure for the keys); returns the new configuration.
create or replace function pgque.set_queue_config(p_queue text, p_config jsonb)
returns jsonb
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    perform pgque._store_config(pgque._configure(v_queue, p_config, false));
    return pgque.queue_config(p_queue);
end
$$;

-- pgque.queue_config(queue): the queue's settings as a JSON object (intervals
-- in seconds), in the shape create_queue and set_queue_config accept.
create or replace function pgque.queue_config(p_queue text)
returns jsonb
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    return jsonb_build_object(
        'ticker_max_count', v_queue.queue_ticker_max_count,
        'ticker_max_lag', extract(epoch from v_queue.queue_ticker_max_lag),
        'ticker_idle_period', extract(epoch from v_queue.queue_ticker_idle_period),
        'rotation_period', extract(epoch from v_queue.queue_rotation_period),
        'max_retries', v_queue.queue_max_retries,
        'idempotency_window', extract(epoch from v_queue.queue_idempotency_window),
        'event_tables', v_queue.queue_ntables);
end
$$;

-- pgque.drop_queue(queue, force): drops a queue with its events, ticks,
-- retries and dead letters. Refuses (PQ011) while consumers are subscribed,
-- unless force.
create or replace function pgque.drop_queue(p_queue text, p_force boolean default false)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_parent text := pgque._event_table(v_queue.queue_id);
begin
    perform from pgque.install_lock for share;  -- see create_queue
    -- Locks in the order the ticker and maintenance take them (the queue's
    -- tick lock, then its maintenance lock, then the queue row, then
    -- tables), so a running ticker or maintenance never deadlocks with a
    -- drop: it finishes its pass, or skips the queue. Once a concurrent drop
    -- of the same queue commits, its lock rows and queue row are gone and the
    -- check below raises PQ001.
    perform pgque._lock_queue(v_queue.queue_id, 'tick', true);
    perform pgque._lock_queue(v_queue.queue_id, 'maint', true);
    perform from pgque.queue where queue_id = v_queue.queue_id for update;
    if not found then
        raise exception using errcode = 'PQ001', message = format('queue %L does not exist',
                                                          pgque._name_for_message(p_queue));
    end if;
    if not p_force and exists (select 1 from pgque.subscription where sub_queue = v_queue.queue_id) then
        raise exception using errcode = 'PQ011',
            message = format('queue %L still has consumers', pgque._name_for_message(p_queue)),
            hint = 'Unsubscribe them first, or drop with force.';
    end if;
    -- Subscriptions go the one way they always go (cursors and retries with
    -- them); groups, ticks and dead letters go with the queue row.
    perform pgque._unsubscribe(
        v_queue.queue_id,
        array(select sub_consumer from pgque.subscription where sub_queue = v_queue.queue_id));
    delete from pgque.queue where queue_id = v_queue.queue_id;
    execute format('drop table pgque.%I cascade', v_parent);
    execute format('drop sequence pgque.%I cascade', v_parent || '_id_seq');
    perform pgque._drop_orphan_readers(false);
    perform pgque._sync_event_writer(false);
end
$$;
