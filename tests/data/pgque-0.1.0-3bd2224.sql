-- pgque 0.1.0 (commit 3bd2224, the first release on main), its install script as
-- pgque.install_script() assembled it: a frozen copy, for the upgrade tests. Never
-- edit it. Unlike the later 0.1.0 (commit 09e6af5) it has no pgque.batch_nack and
-- does not pin search_path; pgque.install() ran it in one transaction.
-- ===== 00_schema.sql =====
-- pgque: schema, roles and tables.
--
-- Everything lives in schema pgque. Event rows live in per-queue tables that
-- create_queue() makes (pgque.event_<queue_id> and its children
-- pgque.event_<queue_id>_<n>); the tables below hold the metadata around them.
-- Every statement here is idempotent: running the install twice changes nothing.

create schema if not exists pgque;
revoke all on schema pgque from public;

-- Roles are cluster-wide. Create them when the installer may; otherwise the
-- grants at the end of the install apply to whichever of them already exist.
do $roles$
declare
    v_role text;
    v_can_create boolean := (select rolsuper or rolcreaterole
                               from pg_catalog.pg_roles where rolname = current_user);
begin
    foreach v_role in array array['pgque_reader', 'pgque_writer', 'pgque_admin'] loop
        if not exists (select 1 from pg_catalog.pg_roles where rolname = v_role) then
            if v_can_create then
                execute format('create role %I nologin', v_role);
            else
                raise notice 'pgque: role % does not exist and % may not create it; skipping its grants',
                    v_role, current_user;
            end if;
        end if;
    end loop;
end
$roles$;

-- One row per queue, with its configuration and rotation state.
create table if not exists pgque.queue (
    queue_id                 integer generated always as identity primary key,
    queue_name               text not null unique,
    queue_event_seq          regclass not null,
    queue_ntables            integer not null default 3,
    queue_cur_table          integer not null default 0,
    queue_rotation_period    interval not null default '2 hours',
    queue_switch_time        timestamptz not null default now(),
    queue_ticker_max_count   integer not null default 500,
    queue_ticker_max_lag     interval not null default '0',
    queue_ticker_idle_period interval not null default '1 minute',
    queue_max_retries        integer not null default 5,
    queue_created            timestamptz not null default now()
);

-- A tick records a snapshot of the database: the events of a batch are those
-- committed as of one tick's snapshot and not as of the previous one.
create table if not exists pgque.tick (
    tick_queue     integer not null references pgque.queue on delete cascade,
    tick_id        bigint not null,
    tick_time      timestamptz not null default now(),
    tick_snapshot  pg_snapshot not null,
    tick_event_seq bigint not null,
    primary key (tick_queue, tick_id)
);

create sequence if not exists pgque.tick_id_seq;
create sequence if not exists pgque.batch_id_seq;

-- A subscription is a consumer's identity on a queue. Its row never changes
-- after insert: receive and ack take it FOR UPDATE as the receive lock, which
-- writes no new row version.
create table if not exists pgque.subscription (
    sub_id       integer generated always as identity primary key,
    sub_queue    integer not null references pgque.queue on delete cascade,
    sub_consumer text not null,
    sub_created  timestamptz not null default now(),
    unique (sub_queue, sub_consumer)
);

-- A subscription's cursor, kept as an append-only log: opening or handing out
-- a piece of a batch and acking insert the new state, and the current state
-- is the row with the highest cur_seq, found by reading the primary key
-- backwards. Nothing here is ever updated: an updated row would grow a chain
-- of versions that every later lookup walks, and a transaction holding back
-- the xmin horizon for minutes would make that chain, and every receive,
-- longer and longer. Maintenance deletes superseded rows in bulk.
create table if not exists pgque.cursor (
    cur_sub       integer not null,
    cur_seq       bigint not null,
    cur_last_tick bigint not null,   -- last tick whose batch is finished
    cur_batch     bigint,            -- id of the open batch, null when none
    cur_next_tick bigint,            -- tick that closes the open batch
    cur_pos       bigint,            -- highest ev_id acked inside the open batch
    cur_handed    bigint,            -- highest ev_id handed out by the latest receive
    cur_end       bigint,            -- highest ev_id of the open batch, once a receive saw its end (0: none)
    cur_time      timestamptz not null default now(),
    primary key (cur_sub, cur_seq)
);

-- Nacked events wait here until their retry time; maintenance moves them back
-- into the log, visible only to the subscription that nacked them.
create table if not exists pgque.retry_queue (
    ev_retry_after timestamptz not null,
    ev_queue       integer not null,
    ev_owner       integer not null references pgque.subscription on delete cascade,
    ev_id          bigint not null,
    ev_time        timestamptz not null,
    ev_retry       integer not null,
    ev_type        text,
    ev_data        text,
    ev_extra1      text,
    ev_extra2      text,
    ev_extra3      text,
    ev_extra4      text
);
create index if not exists retry_queue_due_idx on pgque.retry_queue (ev_queue, ev_retry_after);
create index if not exists retry_queue_owner_idx on pgque.retry_queue (ev_owner);

-- Events that failed more often than the queue allows, with the reason.
create table if not exists pgque.dead_letter (
    dl_id       bigint generated always as identity primary key,
    dl_queue    integer not null references pgque.queue on delete cascade,
    dl_consumer text not null,
    dl_time     timestamptz not null default now(),
    dl_reason   text,
    ev_id       bigint not null,
    ev_time     timestamptz not null,
    ev_txid     xid8,
    ev_retry    integer not null,
    ev_type     text,
    ev_data     text,
    ev_extra1   text,
    ev_extra2   text,
    ev_extra3   text,
    ev_extra4   text
);
create index if not exists dead_letter_queue_idx on pgque.dead_letter (dl_queue, dl_consumer, dl_id);

-- The shape of an event row. Never holds rows: each queue's event tables are
-- made "like" it, and its row type is what receive() hands back.
create table if not exists pgque.event_template (
    ev_id     bigint not null,
    ev_time   timestamptz not null,
    ev_txid   xid8 not null,
    ev_owner  integer,
    ev_retry  integer not null default 0,
    ev_type   text,
    ev_data   text,
    ev_extra1 text,
    ev_extra2 text,
    ev_extra3 text,
    ev_extra4 text
);

-- ===== 10_util.sql =====
-- pgque: small internal helpers shared by the rest of the engine.
--
-- Errors carry SQLSTATEs of class PQ so that clients map them by code, never
-- by message text:
--   PQ001 queue not found           PQ002 consumer not found
--   PQ003 batch not active          PQ004 invalid name
--   PQ005 payload is not JSON       PQ006 queue already exists
--   PQ007 invalid configuration     PQ008 tick outside READ COMMITTED
--   PQ009 dead letter not found     PQ010 event not in the batch
--   PQ011 queue still has consumers PQ012 partition key too long
-- The partition layer adds PQ02x (see its file).

-- pgque.version(): the version of the installed engine.
create or replace function pgque.version()
returns text
language sql immutable
as $$ select '0.1.0'::text $$;

-- pgque._check_name(kind, name): raises PQ004 unless name is 1..100 characters
-- of letters, digits and _ . : - (starting with a letter or digit). '#' is
-- reserved for slot subscriptions, so caller text can never forge one.
create or replace function pgque._check_name(p_kind text, p_name text)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_name is null or p_name !~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}$' then
        raise exception using
            errcode = 'PQ004',
            message = format('invalid %s name %L', p_kind, p_name),
            hint = 'Use 1 to 100 letters, digits, "_", ".", ":" or "-", starting with a letter or digit.';
    end if;
end
$$;

-- pgque._queue_row(name): the queue row, or PQ001.
create or replace function pgque._queue_row(p_queue text)
returns pgque.queue
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
begin
    select * into v_queue from pgque.queue where queue_name = p_queue;
    if not found then
        raise exception using errcode = 'PQ001', message = format('queue %L does not exist', p_queue);
    end if;
    return v_queue;
end
$$;

-- pgque._event_table(queue_id, n): the name (without schema) of event table n
-- of a queue, or of the queue's parent table when n is null. Built from
-- integers only, so nothing a caller types reaches dynamic SQL.
create or replace function pgque._event_table(p_queue_id integer, p_n integer default null)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when p_n is null then 'event_' || p_queue_id::text
                else 'event_' || p_queue_id::text || '_' || p_n::text end
$$;

-- pgque._current_cursor(sub_id): the subscription's current cursor state (the newest
-- row of its cursor log, read backwards along the primary key).
create or replace function pgque._current_cursor(p_sub_id integer)
returns pgque.cursor
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select * from pgque.cursor where cur_sub = p_sub_id order by cur_seq desc limit 1
$$;

-- pgque._save_cursor(cursor): appends the next state of a cursor (whose
-- subscription row the caller holds locked).
create or replace function pgque._save_cursor(p_cur pgque.cursor)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                              cur_pos, cur_handed, cur_end)
    values (p_cur.cur_sub, p_cur.cur_seq + 1, p_cur.cur_last_tick, p_cur.cur_batch,
            p_cur.cur_next_tick, p_cur.cur_pos, p_cur.cur_handed, p_cur.cur_end)
$$;

-- pgque._find_subscription(queue, consumer, lock): the queue row, the subscription
-- row and its current cursor; PQ001 or PQ002 when the queue or subscription
-- is missing. With lock, the subscription row is taken FOR UPDATE first: this
-- is the receive lock that serializes a consumer, and the cursor is read
-- after it is granted (a new statement, so a fresh snapshot).
create or replace function pgque._find_subscription(
    p_queue text, p_consumer text, p_lock boolean,
    out queue pgque.queue, out sub pgque.subscription, out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    queue := pgque._queue_row(p_queue);
    if p_lock then
        select * into sub from pgque.subscription s
         where s.sub_queue = queue.queue_id and s.sub_consumer = p_consumer
           for update;
    else
        select * into sub from pgque.subscription s
         where s.sub_queue = queue.queue_id and s.sub_consumer = p_consumer;
    end if;
    if not found then
        raise exception using
            errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L', p_consumer, p_queue);
    end if;
    cur := pgque._current_cursor(sub.sub_id);
end
$$;

-- pgque._tick_snapshot(queue_id, tick_id): the snapshot stored by a tick.
create or replace function pgque._tick_snapshot(p_queue_id integer, p_tick_id bigint)
returns pg_snapshot
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select tick_snapshot from pgque.tick where tick_queue = p_queue_id and tick_id = p_tick_id
$$;

-- ===== 20_queue.sql =====
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
    if v_result is null or v_result < interval '0' then
        raise exception using errcode = 'PQ007',
            message = format('%s must be a non-negative interval (seconds or an interval literal), not %s',
                             p_key, p_value);
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
            message = format('%s must be an integer from %s to %s, not %s', p_key, p_min, p_max, p_value);
    end if;
    return v_result;
end
$$;

-- pgque._configure(queue, config, creating): the queue row with the settings
-- of config applied. Known keys: ticker_max_count, ticker_max_lag,
-- ticker_idle_period, rotation_period, max_retries, and (only when creating)
-- event_tables. Unknown keys and bad values raise PQ007.
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
        when 'event_tables' then
            if not p_creating then
                raise exception using errcode = 'PQ007',
                    message = 'event_tables can only be set when the queue is created';
            end if;
            p_queue.queue_ntables := pgque._integer(v_key, v_value, 2, 64);
        else
            raise exception using errcode = 'PQ007',
                message = format('unknown queue setting %L', v_key),
                hint = 'Known settings: ticker_max_count, ticker_max_lag, ticker_idle_period, '
                       'rotation_period, max_retries, event_tables.';
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
           queue_max_retries = p_queue.queue_max_retries
     where queue_id = p_queue.queue_id
$$;

-- pgque.create_queue(queue, config, exist_ok): creates a queue with its event
-- tables, sequence and first tick; returns the queue id. An existing queue
-- raises PQ006 unless exist_ok, in which case its id is returned unchanged.
create or replace function pgque.create_queue(
    p_queue text, p_config jsonb default '{}', p_exist_ok boolean default false)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue;
    v_parent text;
    v_child text;
    v_seq text;
    n integer;
begin
    perform pgque._check_name('queue', p_queue);
    -- Serialize creators of the same name so exist_ok is race-free.
    perform pg_advisory_xact_lock(hashtext('pgque.create_queue'), hashtext(p_queue));
    select * into v_queue from pgque.queue where queue_name = p_queue;
    if found then
        if p_exist_ok then
            return v_queue.queue_id;
        end if;
        raise exception using errcode = 'PQ006', message = format('queue %L already exists', p_queue);
    end if;

    -- Insert with the table's defaults first, then apply the caller's settings.
    insert into pgque.queue (queue_name, queue_event_seq)
    values (p_queue, 'pgque.tick_id_seq'::regclass)
    returning * into v_queue;
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
    end loop;
    execute format('revoke all on pgque.%I, pgque.%I from public', v_parent, v_seq);

    v_queue.queue_event_seq := ('pgque.' || v_seq)::regclass;
    perform pgque._store_config(v_queue);

    perform pgque._make_tick(v_queue);
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
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_parent text := pgque._event_table(v_queue.queue_id);
begin
    if not p_force and exists (select 1 from pgque.subscription where sub_queue = v_queue.queue_id) then
        raise exception using errcode = 'PQ011',
            message = format('queue %L still has consumers', p_queue),
            hint = 'Unsubscribe them first, or drop with force.';
    end if;
    -- Subscriptions go the one way they always go (cursors and retries with
    -- them); groups, ticks and dead letters go with the queue row.
    perform pgque._unsubscribe(
        v_queue.queue_id,
        array(select sub_consumer from pgque.subscription where sub_queue = v_queue.queue_id));
    delete from pgque.queue where queue_id = v_queue.queue_id;
    execute format('drop table pgque.%I cascade', v_parent);
    execute format('drop sequence pgque.%I', v_parent || '_id_seq');
end
$$;

-- ===== 30_send.sql =====
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

-- pgque.send(queue, type, payload, partition_key): appends one event to the
-- queue's log in the caller's transaction and returns its ev_id.
-- Raises PQ001 (unknown queue), PQ005 (payload not JSON), PQ012 (key too long).
create or replace function pgque.send(
    p_queue text, p_type text, p_payload text, p_partition_key text default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_id bigint;
begin
    perform pgque._check_payloads(array[p_payload]);
    if octet_length(p_partition_key) > 512 then
        perform pgque._check_keys(array[p_partition_key]);
    end if;
    execute format('insert into pgque.%I (ev_type, ev_data, ev_extra1) values ($1, $2, $3) returning ev_id',
                   pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table))
       into v_id
      using p_type, p_payload, p_partition_key;
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
    -- nextval is taken in array order (ORDER BY the ordinal), so ev_ids follow it.
    execute format(
        'with ins as ('
        '  insert into pgque.%I (ev_id, ev_type, ev_data, ev_extra1)'
        '  select nextval(%L), t, d, k'
        '    from unnest($1, $2, $3) with ordinality as e(t, d, k, i) order by i'
        '  returning ev_id)'
        ' select array_agg(ev_id order by ev_id) from ins',
        pgque._event_table(v_queue.queue_id, v_queue.queue_cur_table),
        v_queue.queue_event_seq::text)
       into v_ids
      using p_types, p_payloads,
            coalesce(p_partition_keys, array_fill(null::text, array[cardinality(p_types)]));
    return coalesce(v_ids, '{}');
end
$$;

-- ===== 40_tick.sql =====
-- pgque: ticks.
--
-- A tick stores pg_current_snapshot() and the position of the queue's event
-- sequence. Consecutive ticks of a queue must be taken in snapshot order, or
-- a batch could miss events: ticks of one queue are serialized by an advisory
-- transaction lock, and each snapshot is taken after that lock is granted,
-- which in READ COMMITTED means after the previous tick committed.

-- pgque._tick_lock_class(): the first key of the two-integer advisory locks
-- pgque takes for ticking ('pgqt'), so they cannot meet other applications'
-- locks that use the same space unless those chose the same constant.
create or replace function pgque._tick_lock_class()
returns integer
language sql immutable
as $$ select 1885827444 $$;

-- pgque._tick_channel(queue_id): the NOTIFY channel announcing ticks of a queue.
create or replace function pgque._tick_channel(p_queue_id integer)
returns text
language sql immutable
as $$ select 'pgque_tick_' || p_queue_id::text $$;

-- pgque.tick_channel(queue): the channel to LISTEN on to hear of new ticks of
-- a queue (one notification per tick, with an empty payload).
create or replace function pgque.tick_channel(p_queue text)
returns text
language sql stable
security definer
set search_path = pg_catalog, pg_temp
as $$ select pgque._tick_channel((pgque._queue_row(p_queue)).queue_id) $$;

-- pgque._make_tick(queue): makes a tick for the queue now, unconditionally, and
-- returns its id. Raises PQ008 outside READ COMMITTED, where the snapshot
-- would be the transaction's and could predate the previous tick.
create or replace function pgque._make_tick(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tick_id bigint;
    v_event_seq bigint;
begin
    if current_setting('transaction_isolation') <> 'read committed' then
        raise exception using errcode = 'PQ008',
            message = 'pgque ticks must be made in a READ COMMITTED transaction';
    end if;
    perform pg_advisory_xact_lock(pgque._tick_lock_class(), p_queue.queue_id);
    -- The sequence position, read before the snapshot is taken: the insert
    -- below is a new statement, hence a new snapshot, after the lock too.
    v_event_seq := coalesce(pg_sequence_last_value(p_queue.queue_event_seq), 0);
    insert into pgque.tick (tick_queue, tick_id, tick_snapshot, tick_event_seq)
    values (p_queue.queue_id, nextval('pgque.tick_id_seq'), pg_current_snapshot(), v_event_seq)
    returning tick_id into v_tick_id;
    -- Wake the queue's consumers. The notification carries nothing: it only
    -- says "look now", and the consumers' poll covers for a lost one.
    perform pg_notify(pgque._tick_channel(p_queue.queue_id), '');
    return v_tick_id;
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
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select * from pgque.tick where tick_queue = p_queue_id order by tick_id desc limit 1
$$;

-- pgque._uncovered_events(queue_id, snapshot): whether any committed event of
-- the queue is not covered by a tick of snapshot, i.e. belongs to a
-- transaction not visible in it (at or past its xmax, or in its xip list).
-- Counting by sequence position cannot tell: an event whose ev_id was taken
-- before a tick by a transaction that committed after it lies below the
-- tick's position yet is not in its batch. An index probe on ev_txid;
-- transactions still in progress are invisible here and simply skipped.
create or replace function pgque._uncovered_events(p_queue_id integer, p_snapshot pg_snapshot)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_found boolean;
begin
    execute format('select exists (select 1 from pgque.%I e'
                   ' where e.ev_txid >= $1 or e.ev_txid = any($2))',
                   pgque._event_table(p_queue_id))
       into v_found
      using pg_snapshot_xmax(p_snapshot), array(select pg_snapshot_xip(p_snapshot));
    return v_found;
end
$$;

-- pgque._tick_due(queue, last_tick): whether the queue's thresholds ask for a
-- tick now: enough events pending (ticker_max_count), or some pending for
-- longer than ticker_max_lag, or none for ticker_idle_period. Pending is
-- counted by sequence position since the last tick; when that says none, an
-- index probe checks for committed events the last tick did not cover.
create or replace function pgque._tick_due(p_queue pgque.queue, p_last pgque.tick)
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
    return p_last.tick_id is null
        or v_pending >= p_queue.queue_ticker_max_count
        or (v_pending > 0 and v_age >= p_queue.queue_ticker_max_lag)
        or v_age >= p_queue.queue_ticker_idle_period;
end
$$;

-- pgque.ticker(queue): ticks the queue if its thresholds ask for it; returns
-- the new tick id, or null when no tick was due.
create or replace function pgque.ticker(p_queue text)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    if pgque._tick_due(v_queue, pgque._last_tick(v_queue.queue_id)) then
        return pgque._make_tick(v_queue);
    end if;
    return null;
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
declare
    v_queue pgque.queue;
    v_count integer := 0;
begin
    for v_queue in select * from pgque.queue order by queue_id loop
        if pgque._tick_due(v_queue, pgque._last_tick(v_queue.queue_id)) then
            perform pgque._make_tick(v_queue);
            v_count := v_count + 1;
        end if;
    end loop;
    return v_count;
end
$$;

-- ===== 50_subscription.sql =====
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
    v_sub_id integer;
begin
    if v_tick is null then
        v_tick := pgque._make_tick(p_queue);
    end if;
    insert into pgque.subscription (sub_queue, sub_consumer)
    values (p_queue.queue_id, p_consumer)
    on conflict (sub_queue, sub_consumer) do nothing
    returning sub_id into v_sub_id;
    if v_sub_id is null then
        return false;
    end if;
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick) values (v_sub_id, 1, v_tick);
    return true;
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
    return pgque._subscribe(pgque._queue_row(p_queue), p_consumer);
end
$$;

-- pgque._unsubscribe(queue_id, consumers): deletes the subscriptions with
-- their cursors (retries go by cascade); returns how many.
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
    delete from pgque.cursor where cur_sub = any(v_ids);
    return coalesce(cardinality(v_ids), 0);
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
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    if position('#' in p_consumer) > 0 then
        raise exception using errcode = 'PQ021',
            message = format('%L is a slot subscription; use unsubscribe_slots', p_consumer);
    end if;
    return pgque._unsubscribe(v_queue.queue_id, array[p_consumer]) > 0;
end
$$;

-- ===== 60_batch.sql =====
-- pgque: batches (receive, ack, nack).
--
-- A batch of a subscription is the set of events committed as of its next
-- tick's snapshot and not as of its last finished tick's snapshot. It is
-- fixed once opened, may be handed out in pieces (max_events), and is
-- finished by ack() only when every event in it was handed out.

-- pgque._batch_events(queue_id, sub_id, prev, next, after, upto, max, ids,
--                     slot, slots):
-- the events of a batch, in ev_id order: those of transactions visible in
-- snapshot next but not in snapshot prev, that are not retries meant for
-- another subscription, with after < ev_id <= upto (upto null: no bound),
-- at most max of them (null: all), only ids when given, and only the hash
-- class slot of slots when slots is given.
--
-- The "dual filter": transactions not visible in prev are those at or above
-- its xmax plus those in progress when it was taken (its xip list), so the
-- ev_txid index is read for one range and a short list of ids instead of
-- whole tables. Every value reaches the statement as a parameter; the only
-- text spliced in is a table name built from the queue id.
create or replace function pgque._batch_events(
    p_queue_id integer, p_sub_id integer, p_prev pg_snapshot, p_next pg_snapshot,
    p_after bigint, p_upto bigint, p_max integer, p_ids bigint[],
    p_slot integer default null, p_slots integer default null)
returns pgque.event_template[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_events pgque.event_template[];
begin
    execute format(
        'select array(select row(e.*)::pgque.event_template'
        '  from pgque.%I e'
        ' where ((e.ev_txid >= $1 and e.ev_txid < $2) or e.ev_txid = any($3))'
        '   and pg_visible_in_snapshot(e.ev_txid, $4)'
        '   and (e.ev_owner is null or e.ev_owner = $5)'
        '   and e.ev_id > $6'
        '   and ($7::bigint is null or e.ev_id <= $7)'
        '   and ($8::bigint[] is null or e.ev_id = any($8))'
        '   and ($10::integer is null'
        '        or (case when e.ev_extra1 is null then 0'
        '                 else (hashtextextended(e.ev_extra1, 0) %% $10 + $10) %% $10 end) = $9)'
        ' order by e.ev_id'
        ' limit $11)',
        pgque._event_table(p_queue_id))
       into v_events
      using pg_snapshot_xmax(p_prev), pg_snapshot_xmax(p_next),
            array(select pg_snapshot_xip(p_prev)), p_next, p_sub_id, p_after, p_upto,
            p_ids, p_slot::bigint, p_slots::bigint, p_max;
    return v_events;
end
$$;

-- pgque._next_tick(queue, cur): the tick that closes the next batch of a
-- cursor with no open batch, or null: the furthest tick whose sequence
-- position is at most ticker_max_count past the cursor's, so a consumer that
-- fell several ticks behind takes them in one batch of bounded size, and at
-- least the very next tick.
create or replace function pgque._next_tick(p_queue pgque.queue, p_cur pgque.cursor)
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(
        (select t.tick_id from pgque.tick t
          where t.tick_queue = p_queue.queue_id and t.tick_id > p_cur.cur_last_tick
            and t.tick_event_seq <= (select l.tick_event_seq from pgque.tick l
                                      where l.tick_queue = p_queue.queue_id
                                        and l.tick_id = p_cur.cur_last_tick)
                                    + p_queue.queue_ticker_max_count
          order by t.tick_id desc limit 1),
        (select t.tick_id from pgque.tick t
          where t.tick_queue = p_queue.queue_id and t.tick_id > p_cur.cur_last_tick
          order by t.tick_id limit 1))
$$;

-- pgque._check_max_events(max_events): 22023 unless null or at least 1.
create or replace function pgque._check_max_events(p_max_events integer)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_max_events is not null and p_max_events < 1 then
        raise exception using errcode = '22023', message = 'max_events must be at least 1';
    end if;
end
$$;

-- pgque._has_next_tick(queue_id, cur): whether a cursor has a batch to open
-- or an open one: the check receive makes before taking any lock, so an idle
-- consumer's poll writes nothing and uses no transaction id.
create or replace function pgque._has_next_tick(p_queue_id integer, p_cur pgque.cursor)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select p_cur.cur_batch is not null
        or exists (select 1 from pgque.tick t
                    where t.tick_queue = p_queue_id and t.tick_id > p_cur.cur_last_tick)
$$;

-- pgque._receive(queue, sub, cur, max_events, slot, slots): opens the next
-- batch of the locked subscription sub (cursor cur), or continues its open
-- one, and returns up to max_events of its events not yet acked, as rows
-- (batch_id, event...). Batches with no events for this subscription (or
-- slot) are consumed on the spot, several in one call, so consumers never
-- see them. An open batch with nothing left yields one row whose ev_id is
-- null; no rows means there is no batch (no tick after the last one).
create or replace function pgque._receive(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor, p_max_events integer,
    p_slot integer default null, p_slots integer default null)
returns table (batch_id bigint, ev_id bigint, ev_time timestamptz, ev_retry integer,
               ev_type text, ev_data text, ev_extra1 text, ev_extra2 text,
               ev_extra3 text, ev_extra4 text)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_events pgque.event_template[];
    v_count integer;
    v_moved boolean := false;
    v_steps integer := 0;
begin
    perform pgque._check_max_events(p_max_events);
    if p_cur.cur_batch is null then
        loop
            p_cur.cur_next_tick := pgque._next_tick(p_queue, p_cur);
            exit when p_cur.cur_next_tick is null;
            -- Ask for one more than max_events: that tells whether the batch goes on.
            v_events := pgque._batch_events(
                p_queue.queue_id, p_sub.sub_id,
                pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
                pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
                0, null, p_max_events + 1, null, p_slot, p_slots);
            exit when coalesce(cardinality(v_events), 0) > 0;
            -- Nothing here for us: consume the batch now instead of a round
            -- trip to hand out and ack nothing (bounded, to keep calls short).
            p_cur.cur_last_tick := p_cur.cur_next_tick;
            v_moved := true;
            v_steps := v_steps + 1;
            exit when v_steps >= 100;
        end loop;
        if coalesce(cardinality(v_events), 0) = 0 then
            if v_moved then
                p_cur.cur_next_tick := null;
                perform pgque._save_cursor(p_cur);
            end if;
            return;
        end if;
        p_cur.cur_batch := nextval('pgque.batch_id_seq');
        p_cur.cur_pos := 0;
        p_cur.cur_end := null;
    else
        v_events := pgque._batch_events(
            p_queue.queue_id, p_sub.sub_id,
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
            pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
            p_cur.cur_pos, null, p_max_events + 1, null, p_slot, p_slots);
    end if;

    v_count := coalesce(cardinality(v_events), 0);
    if p_max_events is not null and v_count > p_max_events then
        v_events := v_events[1:p_max_events];
        v_count := p_max_events;
    else
        p_cur.cur_end := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
    end if;
    p_cur.cur_handed := coalesce(v_events[v_count].ev_id, p_cur.cur_pos);
    perform pgque._save_cursor(p_cur);

    if v_count = 0 then
        return query select p_cur.cur_batch, null::bigint, null::timestamptz, null::integer,
                            null::text, null::text, null::text, null::text, null::text, null::text;
    else
        return query select p_cur.cur_batch, e.ev_id, e.ev_time, e.ev_retry, e.ev_type, e.ev_data,
                            e.ev_extra1, e.ev_extra2, e.ev_extra3, e.ev_extra4
                       from unnest(v_events) e;
    end if;
end
$$;

-- pgque._ack(sub, cur, batch_id): acks what the latest receive handed out of
-- the open batch of the locked subscription sub. When that reached the end of
-- the batch the batch is finished and the cursor moves to its tick (returns
-- true); otherwise the position inside the batch advances (returns false).
-- Raises PQ003 if batch_id is not the open batch.
create or replace function pgque._ack(p_sub pgque.subscription, p_cur pgque.cursor,
                                      p_batch_id bigint)
returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    if p_cur.cur_end is not null and p_cur.cur_handed >= p_cur.cur_end then
        p_cur.cur_last_tick := p_cur.cur_next_tick;
        p_cur.cur_batch := null;
        p_cur.cur_next_tick := null;
        p_cur.cur_pos := null;
        p_cur.cur_handed := null;
        p_cur.cur_end := null;
        perform pgque._save_cursor(p_cur);
        return true;
    end if;
    p_cur.cur_pos := p_cur.cur_handed;
    perform pgque._save_cursor(p_cur);
    return false;
end
$$;

-- pgque._require_batch(sub, cur, batch_id): PQ003 unless batch_id is the open batch.
create or replace function pgque._require_batch(p_sub pgque.subscription, p_cur pgque.cursor,
                                                p_batch_id bigint)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_batch_id is null or p_cur.cur_batch is distinct from p_batch_id then
        raise exception using errcode = 'PQ003',
            message = format('batch %s is not the open batch of consumer %L', p_batch_id,
                             p_sub.sub_consumer);
    end if;
end
$$;

-- pgque._nack(queue, sub, cur, batch_id, ev_ids, retry_after, reason, slot, slots):
-- sends events that the latest receive handed out of the open batch to the
-- retry queue, due after retry_after, or to dead letters with reason once
-- they were retried max_retries times. Returns how many went to dead letters.
-- The batch stays open: ack it as usual. Raises PQ003 if batch_id is not the
-- open batch, PQ010 if an id is not among the events handed out.
create or replace function pgque._nack(
    p_queue pgque.queue, p_sub pgque.subscription, p_cur pgque.cursor, p_batch_id bigint,
    p_ev_ids bigint[],
    p_retry_after interval, p_reason text, p_slot integer default null,
    p_slots integer default null)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_events pgque.event_template[];
    v_dead integer;
begin
    perform pgque._require_batch(p_sub, p_cur, p_batch_id);
    if p_retry_after is null or p_retry_after < interval '0' then
        raise exception using errcode = '22023', message = 'retry_after must not be negative';
    end if;
    if coalesce(cardinality(p_ev_ids), 0) = 0 then
        return 0;
    end if;
    v_events := pgque._batch_events(
        p_queue.queue_id, p_sub.sub_id,
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_last_tick),
        pgque._tick_snapshot(p_queue.queue_id, p_cur.cur_next_tick),
        coalesce(p_cur.cur_pos, 0), p_cur.cur_handed, null, p_ev_ids,
        p_slot, p_slots);
    if coalesce(cardinality(v_events), 0) <> (select count(distinct i) from unnest(p_ev_ids) i) then
        raise exception using errcode = 'PQ010',
            message = format('nack: some of events %s are not among those handed out of batch %s',
                             p_ev_ids, p_batch_id);
    end if;

    insert into pgque.dead_letter (dl_queue, dl_consumer, dl_reason, ev_id, ev_time, ev_txid,
                                   ev_retry, ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3,
                                   ev_extra4)
    select p_queue.queue_id, p_sub.sub_consumer, p_reason, e.ev_id, e.ev_time, e.ev_txid,
           e.ev_retry, e.ev_type, e.ev_data, e.ev_extra1, e.ev_extra2, e.ev_extra3, e.ev_extra4
      from unnest(v_events) e
     where e.ev_retry >= p_queue.queue_max_retries;
    get diagnostics v_dead = row_count;

    insert into pgque.retry_queue (ev_retry_after, ev_queue, ev_owner, ev_id, ev_time, ev_retry,
                                   ev_type, ev_data, ev_extra1, ev_extra2, ev_extra3, ev_extra4)
    select now() + p_retry_after, p_queue.queue_id, p_sub.sub_id, e.ev_id, e.ev_time,
           e.ev_retry + 1, e.ev_type, e.ev_data, e.ev_extra1, e.ev_extra2, e.ev_extra3,
           e.ev_extra4
      from unnest(v_events) e
     where e.ev_retry < p_queue.queue_max_retries;
    return v_dead;
end
$$;

-- pgque._refuse_slot(sub): plain receive/ack/nack refuse slot subscriptions
-- (their consumer name holds '#'); raises PQ021. Slots go through the
-- partition layer, which checks ownership.
create or replace function pgque._refuse_slot(p_sub pgque.subscription)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if position('#' in p_sub.sub_consumer) > 0 then
        raise exception using errcode = 'PQ021',
            message = format('%L is a slot subscription; use receive_partitioned and its ack',
                             p_sub.sub_consumer);
    end if;
end
$$;

-- pgque.receive(queue, consumer, max_events): the consumer's open batch, or
-- its next one, as rows (batch_id, ev_id, ev_time, ev_retry, ev_type,
-- ev_data, ev_extra1..4), at most max_events of them (null: the whole batch).
-- Blocks while another session holds the same subscription's receive lock,
-- then returns the same open batch. An open batch with no events left yields
-- one row with a null ev_id; no rows means no batch is ready.
create or replace function pgque.receive(p_queue text, p_consumer text, p_max_events integer default null)
returns table (batch_id bigint, ev_id bigint, ev_time timestamptz, ev_retry integer,
               ev_type text, ev_data text, ev_extra1 text, ev_extra2 text,
               ev_extra3 text, ev_extra4 text)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._find_subscription(p_queue, p_consumer, false);
    perform pgque._refuse_slot(v.sub);
    if not pgque._has_next_tick((v.queue).queue_id, v.cur) then
        return;  -- idle: no lock taken, nothing written
    end if;
    select * into v from pgque._find_subscription(p_queue, p_consumer, true);
    return query select * from pgque._receive(v.queue, v.sub, v.cur, p_max_events);
end
$$;

-- pgque.ack(queue, consumer, batch_id): acks what the latest receive handed
-- out; true when that finished the batch, false when more of it remains.
create or replace function pgque.ack(p_queue text, p_consumer text, p_batch_id bigint)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    select * into v from pgque._find_subscription(p_queue, p_consumer, true);
    perform pgque._refuse_slot(v.sub);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;

-- pgque.nack(queue, consumer, batch_id, ev_ids, retry_after, reason): sends
-- handed-out events of the open batch to retry (or dead letters); returns
-- how many went to dead letters. Ack the batch afterwards as usual.
create or replace function pgque.nack(
    p_queue text, p_consumer text, p_batch_id bigint, p_ev_ids bigint[],
    p_retry_after interval default '0', p_reason text default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    select * into v from pgque._find_subscription(p_queue, p_consumer, true);
    perform pgque._refuse_slot(v.sub);
    return pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_ev_ids, p_retry_after, p_reason);
end
$$;

-- ===== 65_partition.sql =====
-- pgque: partitioned consumption (consumer groups split into N slots).
--
-- A consumer group c with N slots is N ordinary subscriptions named
-- "c#k/N" (k = 0..N-1), each with its own cursor, retries and dead letters.
-- Slot k receives only the events whose partition key (ev_extra1) hashes to
-- k: slot(K) = (hashtextextended(K, 0) % N + N) % N, NULL key -> slot 0.
-- N is persisted per (queue, consumer) on first use and enforced.
--
-- Ownership: a worker claims slot k with a session advisory lock whose key
-- pgque.slot_lock_key() gives. Receive, ack and nack of a slot refuse unless
-- the calling session holds that lock, so a worker whose session died (and
-- with it the lock) can never ack a batch another worker now owns.
--
-- Errors: PQ020 slot count differs from the persisted one, PQ021 slot
-- subscription used through the plain API, PQ022 invalid slot count, PQ023
-- invalid slot number, PQ024 the session does not own the slot.

-- One row per consumer group: its persisted slot count.
create table if not exists pgque.consumer_group (
    cg_id       integer generated always as identity primary key,
    cg_queue    integer not null references pgque.queue on delete cascade,
    cg_consumer text not null,
    cg_slots    integer not null,
    cg_created  timestamptz not null default now(),
    unique (cg_queue, cg_consumer)
);

-- pgque.max_slots(): the largest slot count a group may have.
create or replace function pgque.max_slots()
returns integer
language sql immutable
as $$ select 1024 $$;

-- pgque._slot_lock_class(): high 32 bits of slot advisory-lock keys ('pgqs').
-- The low 32 bits are the slot subscription's sub_id, unique per database,
-- so slots of different queues and groups never share a key; another
-- application's bigint advisory locks meet ours only if their keys carry
-- this same high word.
create or replace function pgque._slot_lock_class()
returns bigint
language sql immutable
as $$ select 1885827443::bigint $$;

-- pgque._group_lock_class(): high 32 bits of group-membership lock keys ('pgqg').
create or replace function pgque._group_lock_class()
returns bigint
language sql immutable
as $$ select 1885827431::bigint $$;

-- pgque.slot_of(key, slots): the slot a partition key routes to. This is
-- the one definition of routing; the receive filter inlines the same formula.
create or replace function pgque.slot_of(p_key text, p_slots integer)
returns integer
language sql immutable parallel safe
as $$
    select case when p_key is null then 0
                else ((hashtextextended(p_key, 0) % p_slots + p_slots) % p_slots)::integer end
$$;

-- pgque._slot_name(consumer, k, n): the slot subscription's consumer name.
create or replace function pgque._slot_name(p_consumer text, p_slot integer, p_slots integer)
returns text
language sql immutable
as $$ select p_consumer || '#' || p_slot::text || '/' || p_slots::text $$;

-- pgque._check_slot(k, n): PQ022 unless 1 <= n <= max_slots(); PQ023 unless
-- 0 <= k < n.
create or replace function pgque._check_slot(p_slot integer, p_slots integer)
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_slots is null or p_slots < 1 or p_slots > pgque.max_slots() then
        raise exception using errcode = 'PQ022',
            message = format('slot count must be from 1 to %s, not %s', pgque.max_slots(), p_slots);
    end if;
    if p_slot is null or p_slot < 0 or p_slot >= p_slots then
        raise exception using errcode = 'PQ023',
            message = format('slot must be from 0 to %s, not %s', p_slots - 1, p_slot);
    end if;
end
$$;

-- pgque._group(queue, consumer, slots): the group row, checking that slots
-- equals its persisted count (PQ020); PQ002 when the group does not exist.
create or replace function pgque._group(p_queue pgque.queue, p_consumer text, p_slots integer)
returns pgque.consumer_group
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_group pgque.consumer_group;
begin
    select * into v_group from pgque.consumer_group
     where cg_queue = p_queue.queue_id and cg_consumer = p_consumer;
    if not found then
        raise exception using errcode = 'PQ002',
            message = format('consumer group %L is not subscribed to queue %L', p_consumer,
                             p_queue.queue_name);
    end if;
    if p_slots is not null and v_group.cg_slots <> p_slots then
        raise exception using errcode = 'PQ020',
            message = format('consumer group %L of queue %L has %s slots, not %s', p_consumer,
                             p_queue.queue_name, v_group.cg_slots, p_slots),
            hint = 'The slot count is fixed per group: a different one would move keys between '
                   'slots and break per-key order. Unsubscribe the group to change it.';
    end if;
    return v_group;
end
$$;

-- pgque._ensure_group(queue, consumer, slot, slots): validates the name, the
-- slot and the count, and registers the group with its count unless it exists
-- (PQ020 if it exists with another count).
create or replace function pgque._ensure_group(
    p_queue pgque.queue, p_consumer text, p_slot integer, p_slots integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pgque._check_name('consumer', p_consumer);
    perform pgque._check_slot(p_slot, p_slots);
    insert into pgque.consumer_group (cg_queue, cg_consumer, cg_slots)
    values (p_queue.queue_id, p_consumer, p_slots)
    on conflict (cg_queue, cg_consumer) do nothing;
    perform pgque._group(p_queue, p_consumer, p_slots);
end
$$;

-- pgque.subscribe_slots(queue, consumer, slots): subscribes consumer group
-- consumer with slots slots (all of them), persisting the count. Idempotent
-- for the same count; returns how many slot subscriptions were new. Raises
-- PQ020 if the group exists with another count, PQ022 for a bad count,
-- PQ004 for a bad name.
create or replace function pgque.subscribe_slots(p_queue text, p_consumer text, p_slots integer)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_new integer := 0;
    k integer;
begin
    perform pgque._ensure_group(v_queue, p_consumer, 0, p_slots);
    for k in 0 .. p_slots - 1 loop
        if pgque._subscribe(v_queue, pgque._slot_name(p_consumer, k, p_slots)) then
            v_new := v_new + 1;
        end if;
    end loop;
    return v_new;
end
$$;

-- pgque.subscribe_slot(queue, consumer, slot, slots): subscribes one slot
-- of the group (persisting the count on first use); true when new. Same
-- errors as subscribe_slots, plus PQ023 for a bad slot.
create or replace function pgque.subscribe_slot(
    p_queue text, p_consumer text, p_slot integer, p_slots integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    perform pgque._ensure_group(v_queue, p_consumer, p_slot, p_slots);
    return pgque._subscribe(v_queue, pgque._slot_name(p_consumer, p_slot, p_slots));
end
$$;

-- pgque.unsubscribe_slots(queue, consumer): removes a consumer group with all
-- its slot subscriptions (their cursors, open batches and retries); the
-- group may then be subscribed again with another slot count. Returns how
-- many slot subscriptions were removed.
create or replace function pgque.unsubscribe_slots(p_queue text, p_consumer text)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
    v_count integer;
begin
    v_count := pgque._unsubscribe(
        v_queue.queue_id,
        array(select pgque._slot_name(p_consumer, k, v_group.cg_slots)
                from generate_series(0, v_group.cg_slots - 1) k));
    delete from pgque.consumer_group where cg_id = v_group.cg_id;
    return v_count;
end
$$;

-- pgque._slot_sub(queue, consumer, slot, slots, lock): the slot's queue and
-- subscription rows and cursor, after validating slot and slots and the
-- persisted count.
create or replace function pgque._slot_sub(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_lock boolean,
    out queue pgque.queue, out sub pgque.subscription, out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    perform pgque._check_slot(p_slot, p_slots);
    perform pgque._group(pgque._queue_row(p_queue), p_consumer, p_slots);
    select * into v
      from pgque._find_subscription(p_queue, pgque._slot_name(p_consumer, p_slot, p_slots), p_lock);
    queue := v.queue;
    sub := v.sub;
    cur := v.cur;
end
$$;

-- pgque.slot_lock_key(queue, consumer, slot): the bigint key of the session
-- advisory lock that owns the slot. Every client derives it here.
create or replace function pgque.slot_lock_key(p_queue text, p_consumer text, p_slot integer)
returns bigint
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, v_group.cg_slots, false);
    return (pgque._slot_lock_class() << 32) | (v.sub).sub_id;
end
$$;

-- pgque._holds_lock(class, id): whether this session holds the bigint
-- advisory lock (class << 32) | id (in any mode).
create or replace function pgque._holds_lock(p_class bigint, p_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (
        select 1 from pg_locks
         where locktype = 'advisory' and pid = pg_backend_pid() and granted
           and classid = p_class::oid and objid = p_id::oid and objsubid = 1)
$$;

-- pgque._holds_slot(sub_id): whether this session holds the slot's lock.
create or replace function pgque._holds_slot(p_sub_id integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._holds_lock(pgque._slot_lock_class(), p_sub_id) $$;

-- pgque._require_owner(sub, slot): PQ024 unless this session holds the lock.
create or replace function pgque._require_owner(p_sub pgque.subscription)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._holds_slot(p_sub.sub_id) then
        raise exception using errcode = 'PQ024',
            message = format('this session does not own slot %L', p_sub.sub_consumer),
            hint = 'Claim the slot first (pgque.claim_slot); a session that lost its lock '
                   'must not receive or ack for the slot.';
    end if;
end
$$;

-- pgque.claim_slot(queue, consumer, slot): tries, without waiting, to take
-- the slot's session advisory lock; true when this session now holds it
-- (also when it already did; the lock is never taken twice).
create or replace function pgque.claim_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key bigint := pgque.slot_lock_key(p_queue, p_consumer, p_slot);
begin
    return pgque._holds_slot((v_key & x'ffffffff'::bigint)::integer)
        or pg_try_advisory_lock(v_key);
end
$$;

-- pgque.release_slot(queue, consumer, slot): releases the slot's lock if
-- this session holds it; true when it did.
create or replace function pgque.release_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key bigint := pgque.slot_lock_key(p_queue, p_consumer, p_slot);
    v_released boolean := false;
begin
    while pg_advisory_unlock(v_key) loop
        v_released := true;
    end loop;
    return v_released;
end
$$;

-- pgque.receive_partitioned(queue, consumer, slot, slots, max_events): like
-- receive(), for slot slot of slots of a consumer group: opens the slot's
-- batch under the receive lock and returns only the events whose key routes
-- to the slot. Refuses (PQ024) unless this session owns the slot.
create or replace function pgque.receive_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer,
    p_max_events integer default null)
returns table (batch_id bigint, ev_id bigint, ev_time timestamptz, ev_retry integer,
               ev_type text, ev_data text, ev_extra1 text, ev_extra2 text,
               ev_extra3 text, ev_extra4 text)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    -- Check ownership before taking the row lock, so a non-owner never waits,
    -- and whether there is anything to receive, so an idle poll writes nothing.
    perform pgque._check_max_events(p_max_events);
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, false);
    perform pgque._require_owner(v.sub);
    if not pgque._has_next_tick((v.queue).queue_id, v.cur) then
        return;  -- idle: no lock taken, nothing written
    end if;
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    return query select * from pgque._receive(v.queue, v.sub, v.cur, p_max_events, p_slot,
                                              p_slots);
end
$$;

-- pgque.ack_partitioned(queue, consumer, slot, slots, batch_id): ack() for a
-- slot; refuses (PQ024) unless this session owns the slot.
create or replace function pgque.ack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._ack(v.sub, v.cur, p_batch_id);
end
$$;

-- pgque.nack_partitioned(queue, consumer, slot, slots, batch_id, ev_ids,
-- retry_after, reason): nack() for a slot (skip policy: the events go to the
-- slot's retry queue, the batch goes on); refuses (PQ024) unless this session
-- owns the slot.
create or replace function pgque.nack_partitioned(
    p_queue text, p_consumer text, p_slot integer, p_slots integer, p_batch_id bigint,
    p_ev_ids bigint[], p_retry_after interval default '0', p_reason text default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, p_slots, true);
    perform pgque._require_owner(v.sub);
    return pgque._nack(v.queue, v.sub, v.cur, p_batch_id, p_ev_ids, p_retry_after, p_reason,
                       p_slot, p_slots);
end
$$;

-- pgque.join_group(queue, consumer): registers this session as a live
-- member of the group with a shared session advisory lock, so workers can
-- count each other (see group_status) and share slots fairly. Idempotent.
create or replace function pgque.join_group(p_queue text, p_consumer text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_group pgque.consumer_group := pgque._group(pgque._queue_row(p_queue), p_consumer, null);
    v_key bigint := (pgque._group_lock_class() << 32) | v_group.cg_id;
begin
    if pgque._holds_lock(pgque._group_lock_class(), v_group.cg_id) then
        return false;
    end if;
    perform pg_advisory_lock_shared(v_key);
    return true;
end
$$;

-- pgque.group_status(queue, consumer): one row per slot of the group: slot,
-- owner backend pid (null when unowned), whether this session is the owner,
-- the number of live members (sessions that joined the group), and this
-- session's rank among them by backend pid (0-based; null if not a member).
-- A member's fair share is members' integer share of the slots, plus one for
-- the first (slots % members) ranks, so the shares always add up to slots.
create or replace function pgque.group_status(p_queue text, p_consumer text)
returns table (slot integer, owner_pid integer, mine boolean, members integer,
               my_rank integer)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group := pgque._group(v_queue, p_consumer, null);
begin
    return query
    with locks as materialized (
        select l.classid, l.objid, l.pid from pg_locks l
         where l.locktype = 'advisory' and l.granted and l.objsubid = 1
           -- Advisory locks are per database, but pg_locks shows the whole
           -- cluster: without this, another database's slots would look owned.
           and l.database = (select oid from pg_database where datname = current_database())
           and l.classid in (pgque._slot_lock_class()::oid, pgque._group_lock_class()::oid)),
    members as (
        select array_agg(distinct m.pid order by m.pid) as pids from locks m
         where m.classid = pgque._group_lock_class()::oid and m.objid = v_group.cg_id::oid)
    select k::integer,
           o.pid,
           coalesce(o.pid = pg_backend_pid(), false),
           coalesce(cardinality(members.pids), 0),
           array_position(members.pids, pg_backend_pid()) - 1
      from generate_series(0, v_group.cg_slots - 1) k
      cross join members
      left join pgque.subscription s
        on s.sub_queue = v_queue.queue_id
       and s.sub_consumer = pgque._slot_name(p_consumer, k, v_group.cg_slots)
      left join locks o
        on o.classid = pgque._slot_lock_class()::oid and o.objid = s.sub_id::oid
     order by k;
end
$$;

-- ===== 70_retry.sql =====
-- pgque: retries and dead letters.

-- pgque._insert_events_sql(queue): the statement that moves rows of a CTE
-- named "src" into the queue's current event table, keeping ev_id, ev_time,
-- ev_retry, ev_type, ev_data and the extras, with a new ev_txid (the moving
-- transaction's) and src.ev_owner as the only subscription that sees them.
create or replace function pgque._insert_events_sql(p_queue pgque.queue)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(
        'insert into pgque.%I (ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data,'
        '                      ev_extra1, ev_extra2, ev_extra3, ev_extra4)'
        ' select ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data,'
        '        ev_extra1, ev_extra2, ev_extra3, ev_extra4 from src order by ev_id',
        pgque._event_table(p_queue.queue_id, p_queue.queue_cur_table))
$$;

-- pgque._maint_retry(queue): moves every due retry of the queue back into the
-- log in one statement; returns how many. Bumps the event sequence when it
-- moved any, so the ticker sees pending events and ticks them out promptly.
create or replace function pgque._maint_retry(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    execute 'with src as (delete from pgque.retry_queue'
            '              where ev_queue = $1 and ev_retry_after <= now()'
            '          returning *) '
            || pgque._insert_events_sql(p_queue)
      using p_queue.queue_id;
    get diagnostics v_count = row_count;
    if v_count > 0 then
        perform nextval(p_queue.queue_event_seq);
    end if;
    return v_count;
end
$$;

-- pgque.dead_letters(queue, consumer, limit, after_id): dead letters of a
-- queue (of one consumer, or of every slot of a consumer group, when given),
-- oldest first, after dl_id after_id.
create or replace function pgque.dead_letters(
    p_queue text, p_consumer text default null, p_limit integer default 100,
    p_after_id bigint default 0)
returns table (dl_id bigint, consumer text, dl_time timestamptz, reason text, ev_id bigint,
               ev_time timestamptz, ev_retry integer, ev_type text, ev_data text,
               ev_extra1 text, ev_extra2 text, ev_extra3 text, ev_extra4 text)
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
begin
    return query
        select d.dl_id, d.dl_consumer, d.dl_time, d.dl_reason, d.ev_id, d.ev_time, d.ev_retry,
               d.ev_type, d.ev_data, d.ev_extra1, d.ev_extra2, d.ev_extra3, d.ev_extra4
          from pgque.dead_letter d
         where d.dl_queue = v_queue.queue_id
           and (p_consumer is null or d.dl_consumer = p_consumer
                or split_part(d.dl_consumer, '#', 1) = p_consumer)
           and d.dl_id > coalesce(p_after_id, 0)
         order by d.dl_id
         limit p_limit;
end
$$;

-- pgque.replay_dead_letter(queue, dl_id): puts a dead letter back into the
-- log for the consumer that dead-lettered it (same ev_id, type, payload and
-- extras; retry count back to 0) and removes it from dead letters. Returns
-- the ev_id. Raises PQ009 if there is no such dead letter, PQ002 if its
-- consumer is no longer subscribed.
create or replace function pgque.replay_dead_letter(p_queue text, p_dl_id bigint)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_dead pgque.dead_letter;
    v_owner integer;
begin
    delete from pgque.dead_letter where dl_queue = v_queue.queue_id and dl_id = p_dl_id
    returning * into v_dead;
    if not found then
        raise exception using errcode = 'PQ009',
            message = format('queue %L has no dead letter %s', p_queue, p_dl_id);
    end if;
    select sub_id into v_owner from pgque.subscription
     where sub_queue = v_queue.queue_id and sub_consumer = v_dead.dl_consumer;
    if not found then
        raise exception using errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L', v_dead.dl_consumer, p_queue);
    end if;
    execute 'with src as (select $1::bigint as ev_id, $2::timestamptz as ev_time,'
            '                    $3::integer as ev_owner, 0 as ev_retry, $4::text as ev_type,'
            '                    $5::text as ev_data, $6::text as ev_extra1, $7::text as ev_extra2,'
            '                    $8::text as ev_extra3, $9::text as ev_extra4) '
            || pgque._insert_events_sql(v_queue)
      using v_dead.ev_id, v_dead.ev_time, v_owner, v_dead.ev_type, v_dead.ev_data,
            v_dead.ev_extra1, v_dead.ev_extra2, v_dead.ev_extra3, v_dead.ev_extra4;
    perform nextval(v_queue.queue_event_seq);
    return v_dead.ev_id;
end
$$;

-- pgque.purge_dead_letters(queue, consumer, dl_ids): deletes dead letters of
-- a queue: the given ids, or all (of the consumer or group, when given) when
-- ids is null. Returns how many.
create or replace function pgque.purge_dead_letters(
    p_queue text, p_consumer text default null, p_dl_ids bigint[] default null)
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_count bigint;
begin
    delete from pgque.dead_letter
     where dl_queue = v_queue.queue_id
       and (p_consumer is null or dl_consumer = p_consumer
            or split_part(dl_consumer, '#', 1) = p_consumer)
       and (p_dl_ids is null or dl_id = any(p_dl_ids));
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- ===== 80_maint.sql =====
-- pgque: maintenance (rotation, retry re-insertion, tick and cursor cleanup).
--
-- Each step is safe to run concurrently and repeatedly: steps of one queue
-- are serialized by an advisory transaction lock, and a second caller simply
-- skips the queue.

-- pgque._maint_lock_class(): first key of maintenance advisory locks ('pgqm').
create or replace function pgque._maint_lock_class()
returns integer
language sql immutable
as $$ select 1885827437 $$;

-- pgque._consumed_floor(queue_id): a transaction id below which every event
-- of the queue has been consumed by every subscription: the lowest xmin of the
-- subscriptions' last finished ticks (with no subscription, of the newest
-- tick). Null when unknown.
create or replace function pgque._consumed_floor(p_queue_id integer)
returns xid8
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when exists (select 1 from pgque.subscription where sub_queue = p_queue_id)
           then (select min(pg_snapshot_xmin(t.tick_snapshot))
                   from pgque.subscription s
                   cross join lateral pgque._current_cursor(s.sub_id) c
                   join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick
                  where s.sub_queue = p_queue_id)
           else pg_snapshot_xmin((pgque._last_tick(p_queue_id)).tick_snapshot)
           end
$$;

-- pgque._maint_rotate(queue): truncates every event table other than the
-- current one whose events all subscriptions have consumed, then switches
-- the current table when rotation_period has passed and the next table is
-- empty. Returns the number of tables truncated plus one if it switched.
--
-- A producer that read the old current table just before a switch may still
-- be inserting into it. The table is therefore locked before it is judged:
-- the lock waits for such writers to finish, and only then is its newest
-- ev_txid compared with the consumed floor. The lock wait is bounded so a
-- long transaction stalls rotation, never consumers.
create or replace function pgque._maint_rotate(p_queue pgque.queue)
returns integer
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_floor xid8 := pgque._consumed_floor(p_queue.queue_id);
    v_lock_timeout text := current_setting('lock_timeout');
    v_table text;
    v_nonempty boolean;
    v_max xid8;
    v_done integer := 0;
    n integer;
begin
    for n in 0 .. p_queue.queue_ntables - 1 loop
        continue when n = p_queue.queue_cur_table or v_floor is null;
        v_table := pgque._event_table(p_queue.queue_id, n);
        execute format('select exists (select 1 from pgque.%I)', v_table) into v_nonempty;
        continue when not v_nonempty;
        begin
            perform set_config('lock_timeout', '50ms', true);
            execute format('lock table pgque.%I in access exclusive mode', v_table);
            perform set_config('lock_timeout', v_lock_timeout, true);
            execute format('select max(ev_txid) from pgque.%I', v_table) into v_max;
            if v_max is null or v_max < v_floor then
                execute format('truncate pgque.%I', v_table);
                v_done := v_done + 1;
            end if;
        exception when lock_not_available then
            null;  -- busy: try again at the next maintenance pass
        end;
    end loop;

    if now() - p_queue.queue_switch_time >= p_queue.queue_rotation_period then
        n := (p_queue.queue_cur_table + 1) % p_queue.queue_ntables;
        execute format('select exists (select 1 from pgque.%I)',
                       pgque._event_table(p_queue.queue_id, n))
           into v_nonempty;
        if not v_nonempty then
            update pgque.queue set queue_cur_table = n, queue_switch_time = now()
             where queue_id = p_queue.queue_id;
            v_done := v_done + 1;
        end if;
    end if;
    return v_done;
end
$$;

-- pgque._maint_ticks(queue): deletes, in one statement, the ticks no
-- subscription needs any more (all before the oldest last tick; with no
-- subscription, all but the newest). Returns how many.
create or replace function pgque._maint_ticks(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keep bigint;
    v_count bigint;
begin
    select coalesce((select min(c.cur_last_tick)
                       from pgque.subscription s cross join lateral pgque._current_cursor(s.sub_id) c
                      where s.sub_queue = p_queue.queue_id),
                    (pgque._last_tick(p_queue.queue_id)).tick_id)
      into v_keep;
    delete from pgque.tick where tick_queue = p_queue.queue_id and tick_id < v_keep;
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque._maint_cursors(queue): deletes, in one statement, the superseded rows
-- of the cursor logs of the queue's subscriptions. Returns how many.
create or replace function pgque._maint_cursors(p_queue pgque.queue)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    delete from pgque.cursor c
     using pgque.subscription s
     where s.sub_queue = p_queue.queue_id and c.cur_sub = s.sub_id
       and c.cur_seq < (pgque._current_cursor(s.sub_id)).cur_seq;
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque.maint(queue): runs every maintenance step for one queue (all queues
-- when null) and reports what it did as rows (queue_name, step, amount).
-- A queue whose maintenance is already running elsewhere is skipped.
create or replace function pgque.maint(p_queue text default null)
returns table (queue_name text, step text, amount bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue;
    v_amount bigint;
begin
    if p_queue is not null then
        perform pgque._queue_row(p_queue);
    end if;
    for v_queue in select * from pgque.queue q
                    where p_queue is null or q.queue_name = p_queue
                    order by q.queue_id loop
        continue when not pg_try_advisory_xact_lock(pgque._maint_lock_class(), v_queue.queue_id);
        v_amount := pgque._maint_rotate(v_queue);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'rotate'; amount := v_amount;
            return next;
            select * into v_queue from pgque.queue q where q.queue_id = v_queue.queue_id;
        end if;
        v_amount := pgque._maint_retry(v_queue);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'retry'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._maint_ticks(v_queue);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'ticks'; amount := v_amount;
            return next;
        end if;
        v_amount := pgque._maint_cursors(v_queue);
        if v_amount > 0 then
            queue_name := v_queue.queue_name; step := 'cursors'; amount := v_amount;
            return next;
        end if;
    end loop;
end
$$;

-- ===== 85_cron.sql =====
-- pgque: ticking from inside the database with pg_cron.
--
-- An alternative to running a pgque.Ticker (or Workers, which run one) when
-- the pg_cron extension is installed in this database (cron.database_name
-- names it). pg_cron schedules by the minute in most versions, so its job
-- runs pgque.ticker_loop(), which ticks every 100 ms for just under a minute
-- and is started again by the next run. The loop takes the same advisory lock
-- as the Python Ticker, so only one of them ticks a database at a time.

-- pgque._ticker_lock_key(): the bigint advisory lock that elects the active
-- ticker of a database ('pgqk' << 32, shared with pgque.Ticker in Python).
create or replace function pgque._ticker_lock_key()
returns bigint
language sql immutable
as $$ select 1885827435::bigint << 32 $$;

-- pgque.ticker_loop(seconds, interval_ms): for about seconds seconds, every
-- interval_ms milliseconds, ticks every queue that has pending events
-- (pgque.ticker()), committing each time, and runs maintenance every second.
-- Returns at once when another ticker holds the election lock. A procedure
-- with transaction control may not be SECURITY DEFINER nor pin search_path,
-- so every name in it is schema-qualified; grant EXECUTE to admins only.
create or replace procedure pgque.ticker_loop(
    p_seconds double precision default 58, p_interval_ms integer default 100)
language plpgsql
as $$
declare
    v_until timestamptz := pg_catalog.clock_timestamp()
                           + pg_catalog.make_interval(secs => p_seconds);
    v_next_maint timestamptz := pg_catalog.clock_timestamp();
begin
    if not pg_catalog.pg_try_advisory_lock(pgque._ticker_lock_key()) then
        return;
    end if;
    while pg_catalog.clock_timestamp() < v_until loop
        perform pgque.ticker();
        if pg_catalog.clock_timestamp() >= v_next_maint then
            perform pgque.maint();
            v_next_maint := pg_catalog.clock_timestamp() + interval '1 second';
        end if;
        commit;
        perform pg_catalog.pg_sleep(p_interval_ms / 1000.0);
    end loop;
    perform pg_catalog.pg_advisory_unlock(pgque._ticker_lock_key());
end
$$;

-- pgque.start_cron(): schedules pgque.ticker_loop() every minute with
-- pg_cron (job 'pgque-ticker'), replacing an earlier schedule of that name;
-- returns the job id. Raises PQ030 when pg_cron is not installed here.
create or replace function pgque.start_cron()
returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_job bigint;
begin
    if not exists (select 1 from pg_catalog.pg_extension where extname = 'pg_cron') then
        raise exception using errcode = 'PQ030',
            message = 'pg_cron is not installed in this database',
            hint = 'Add pg_cron to shared_preload_libraries, set cron.database_name to this '
                   'database and CREATE EXTENSION pg_cron; or run pgque.Ticker / workers instead.';
    end if;
    execute 'select cron.schedule($1, $2, $3)'
       into v_job
      using 'pgque-ticker', '* * * * *', 'call pgque.ticker_loop()';
    return v_job;
end
$$;

-- pgque.stop_cron(): removes the 'pgque-ticker' job; true when there was one.
-- A loop already running finishes its minute. Raises PQ030 without pg_cron.
create or replace function pgque.stop_cron()
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_found boolean;
begin
    if not exists (select 1 from pg_catalog.pg_extension where extname = 'pg_cron') then
        raise exception using errcode = 'PQ030',
            message = 'pg_cron is not installed in this database';
    end if;
    execute 'select exists (select 1 from cron.job where jobname = $1)' into v_found
      using 'pgque-ticker';
    if v_found then
        execute 'select cron.unschedule($1)' using 'pgque-ticker';
    end if;
    return v_found;
end
$$;

-- ===== 90_info.sql =====
-- pgque: what operators look at (queues and consumers).

-- pgque._oldest_unconsumed(queue_id, sub_id, snapshot, slot, slots): ev_time
-- of the earliest-written event the subscription has not consumed yet (not
-- visible in the snapshot of its last finished tick; only the slot's events
-- when slots is given), or null. Reads the ev_txid index upward from the
-- snapshot's xmin and stops at the first such event.
create or replace function pgque._oldest_unconsumed(
    p_queue_id integer, p_sub_id integer, p_snapshot pg_snapshot,
    p_slot integer default null, p_slots integer default null)
returns timestamptz
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_time timestamptz;
begin
    execute format(
        'select e.ev_time from pgque.%I e'
        ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
        '   and (e.ev_owner is null or e.ev_owner = $3)'
        '   and ($5::integer is null or pgque.slot_of(e.ev_extra1, $5) = $4)'
        ' order by e.ev_txid limit 1',
        pgque._event_table(p_queue_id))
       into v_time
      using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
    return v_time;
end
$$;

-- pgque._queue_info: one row per queue with its settings, its newest tick and
-- how many events were sent since that tick.
create or replace view pgque._queue_info as
select q.queue_name,
       q.queue_id,
       q.queue_ntables as event_tables,
       q.queue_cur_table as current_table,
       q.queue_rotation_period as rotation_period,
       q.queue_switch_time as last_rotation,
       q.queue_ticker_max_count as ticker_max_count,
       q.queue_ticker_max_lag as ticker_max_lag,
       q.queue_ticker_idle_period as ticker_idle_period,
       q.queue_max_retries as max_retries,
       t.tick_id as last_tick_id,
       t.tick_time as last_tick_time,
       now() - t.tick_time as last_tick_age,
       coalesce(pg_sequence_last_value(q.queue_event_seq), 0) as event_seq,
       greatest(coalesce(pg_sequence_last_value(q.queue_event_seq), 0)
                - coalesce(t.tick_event_seq, 0), 0) as events_since_last_tick,
       (select count(*) from pgque.subscription s where s.sub_queue = q.queue_id) as consumers
  from pgque.queue q
  left join lateral (select * from pgque.tick t where t.tick_queue = q.queue_id
                      order by t.tick_id desc limit 1) t on true;

-- pgque._consumer_info: one row per subscription: where its cursor is, how far
-- behind it is (ticks, events by sequence position, time), its open batch and
-- the age of its oldest unconsumed event.
create or replace view pgque._consumer_info as
select q.queue_name,
       s.sub_consumer as consumer_name,
       s.sub_id,
       c.cur_last_tick as last_tick_id,
       t.tick_time as last_tick_time,
       now() - t.tick_time as lag,
       (select count(*) from pgque.tick n
         where n.tick_queue = q.queue_id and n.tick_id > c.cur_last_tick) as ticks_behind,
       greatest(coalesce(pg_sequence_last_value(q.queue_event_seq), 0)
                - coalesce(t.tick_event_seq, 0), 0) as pending_events,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       now() - pgque._oldest_unconsumed(q.queue_id, s.sub_id, t.tick_snapshot)
           as oldest_unconsumed_age,
       (select count(*) from pgque.retry_queue r where r.ev_owner = s.sub_id) as retries_waiting,
       (select count(*) from pgque.dead_letter d
         where d.dl_queue = q.queue_id and d.dl_consumer = s.sub_consumer) as dead_letters
  from pgque.subscription s
  join pgque.queue q on q.queue_id = s.sub_queue
  cross join lateral pgque._current_cursor(s.sub_id) c
  left join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick;

-- pgque._pending_events(queue_id, sub_id, snapshot, slot, slots): how many
-- committed events the subscription has not consumed yet (not visible in the
-- snapshot of its last finished tick), only the slot's when slots is given.
-- Counts at most one million, to bound the cost of looking.
create or replace function pgque._pending_events(
    p_queue_id integer, p_sub_id integer, p_snapshot pg_snapshot,
    p_slot integer default null, p_slots integer default null)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count bigint;
begin
    execute format(
        'select count(*) from (select 1 from pgque.%I e'
        ' where e.ev_txid >= $1 and not pg_visible_in_snapshot(e.ev_txid, $2)'
        '   and (e.ev_owner is null or e.ev_owner = $3)'
        '   and ($5::integer is null or pgque.slot_of(e.ev_extra1, $5) = $4)'
        ' limit 1000000) pending',
        pgque._event_table(p_queue_id))
       into v_count
      using pg_snapshot_xmin(p_snapshot), p_snapshot, p_sub_id, p_slot, p_slots;
    return v_count;
end
$$;

-- pgque._partition_slot_status: one row per slot of every consumer group:
-- its owner (the backend holding the slot's advisory lock), how much it has
-- not consumed, and whether it looks stalled (events waiting for over a
-- minute while nobody owns it or it has not moved for a minute).
create or replace view pgque._partition_slot_status as
select q.queue_name,
       g.cg_consumer as consumer_name,
       k.slot,
       g.cg_slots as slots,
       l.pid as owner_pid,
       pgque._pending_events(q.queue_id, s.sub_id, t.tick_snapshot, k.slot, g.cg_slots)
           as pending_events,
       (select count(*) from pgque.tick n
         where n.tick_queue = q.queue_id and n.tick_id > c.cur_last_tick) as ticks_behind,
       o.age as oldest_unconsumed_age,
       now() - t.tick_time as lag,
       c.cur_batch as open_batch_id,
       c.cur_time as last_active,
       (select count(*) from pgque.retry_queue r where r.ev_owner = s.sub_id) as retries_waiting,
       coalesce(o.age > interval '1 minute'
                and (l.pid is null or now() - c.cur_time > interval '1 minute'),
                false) as stalled
  from pgque.consumer_group g
  join pgque.queue q on q.queue_id = g.cg_queue
  cross join lateral generate_series(0, g.cg_slots - 1) as k(slot)
  join pgque.subscription s
    on s.sub_queue = g.cg_queue and s.sub_consumer = pgque._slot_name(g.cg_consumer, k.slot, g.cg_slots)
  cross join lateral pgque._current_cursor(s.sub_id) c
  left join pgque.tick t on t.tick_queue = s.sub_queue and t.tick_id = c.cur_last_tick
  -- Read once: both the age column and the stalled flag need it.
  cross join lateral (select now() - pgque._oldest_unconsumed(q.queue_id, s.sub_id,
                                        t.tick_snapshot, k.slot, g.cg_slots) as age) o
  left join pg_locks l
    on l.locktype = 'advisory' and l.granted and l.objsubid = 1
   and l.database = (select oid from pg_database where datname = current_database())
   and l.classid = pgque._slot_lock_class()::oid and l.objid = s.sub_id::oid;

-- The info views read event tables and sequences that callers have no
-- privileges on, so they are reached through SECURITY DEFINER functions.

-- pgque.get_queue_info(): the rows of pgque.queue_info.
create or replace function pgque.get_queue_info()
returns setof pgque._queue_info
language sql stable
security definer
set search_path = pg_catalog, pg_temp
as $$ select * from pgque._queue_info $$;

-- pgque.get_consumer_info(): the rows of pgque.consumer_info.
create or replace function pgque.get_consumer_info()
returns setof pgque._consumer_info
language sql stable
security definer
set search_path = pg_catalog, pg_temp
as $$ select * from pgque._consumer_info $$;

-- pgque.queue_info / pgque.consumer_info: what operators query.
create or replace view pgque.queue_info as select * from pgque.get_queue_info();
create or replace view pgque.consumer_info as select * from pgque.get_consumer_info();

-- pgque.get_partition_slot_status(): the rows of pgque.partition_slot_status.
create or replace function pgque.get_partition_slot_status()
returns setof pgque._partition_slot_status
language sql stable
security definer
set search_path = pg_catalog, pg_temp
as $$ select * from pgque._partition_slot_status $$;

create or replace view pgque.partition_slot_status as
select * from pgque.get_partition_slot_status();

-- ===== 99_grants.sql =====
-- pgque: privileges.
--
-- Callers never touch pgque's tables: they call functions that run as the
-- installer (SECURITY DEFINER, with search_path pinned to pg_catalog), and
-- read the info views. Execution is revoked from PUBLIC and granted by role:
--   pgque_writer  send events
--   pgque_reader  subscribe, receive, ack, nack, read the info views
--   pgque_admin   everything, including queue management and maintenance

revoke all on all routines in schema pgque from public;
revoke all on all tables in schema pgque from public;
revoke all on all sequences in schema pgque from public;

do $grants$
declare
    v_writer text[] := array[
        'send(text,text,text,text)', 'send(text,text,jsonb,text)',
        'send_batch(text,text[],text[],text[])', 'version()'];
    v_reader text[] := array[
        'subscribe(text,text)', 'unsubscribe(text,text)', 'receive(text,text,integer)',
        'ack(text,text,bigint)', 'nack(text,text,bigint,bigint[],interval,text)',
        'queue_config(text)', 'dead_letters(text,text,integer,bigint)', 'version()',
        'get_queue_info()', 'get_consumer_info()', 'get_partition_slot_status()',
        'subscribe_slots(text,text,integer)', 'subscribe_slot(text,text,integer,integer)',
        'unsubscribe_slots(text,text)', 'slot_lock_key(text,text,integer)',
        'claim_slot(text,text,integer)', 'release_slot(text,text,integer)',
        'receive_partitioned(text,text,integer,integer,integer)',
        'ack_partitioned(text,text,integer,integer,bigint)',
        'nack_partitioned(text,text,integer,integer,bigint,bigint[],interval,text)',
        'join_group(text,text)', 'group_status(text,text)', 'slot_of(text,integer)',
        'max_slots()', 'tick_channel(text)'];
    v_fn text;
begin
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_writer') then
        execute 'grant usage on schema pgque to pgque_writer';
        foreach v_fn in array v_writer loop
            execute format('grant execute on function pgque.%s to pgque_writer', v_fn);
        end loop;
    end if;
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_reader') then
        execute 'grant usage on schema pgque to pgque_reader';
        foreach v_fn in array v_reader loop
            execute format('grant execute on function pgque.%s to pgque_reader', v_fn);
        end loop;
        execute 'grant select on pgque.queue_info, pgque.consumer_info, '
                'pgque.partition_slot_status to pgque_reader';
    end if;
    if exists (select 1 from pg_catalog.pg_roles where rolname = 'pgque_admin') then
        execute 'grant usage on schema pgque to pgque_admin';
        -- Every public function; the internal ones (leading underscore) are
        -- reached only through them.
        for v_fn in select p.oid::regprocedure::text
                      from pg_catalog.pg_proc p
                     where p.pronamespace = 'pgque'::regnamespace and p.proname !~ '^_' loop
            execute format('grant execute on routine %s to pgque_admin', v_fn);
        end loop;
        execute 'grant select on pgque.queue_info, pgque.consumer_info, '
                'pgque.partition_slot_status to pgque_admin';
    end if;
end
$grants$;
