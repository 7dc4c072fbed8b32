-- pgque: small internal helpers shared by the rest of the engine.
--
-- Errors carry SQLSTATEs of class PQ so that clients map them by code, never
-- by message text. pgque/errors.py is their catalogue (a class per code,
-- saying when it is raised); the suite checks that every code raised here
-- has its class there.

-- pgque.version(): the version of the installed engine (the install script
-- puts the package's version, pgque.__version__, in its place).
create or replace function pgque.version()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select '@PGQUE_VERSION@'::text $$;

-- pgque._name_for_message(text): a caller-supplied name (or other text) as
-- error messages show it: cut to 100 characters, with "..." when it was
-- longer, so that a huge name does not make a huge message (and server log
-- line). Every message that echoes what a caller passed goes through it.
create or replace function pgque._name_for_message(p_text text)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when length(p_text) > 100 then left(p_text, 100) || '...' else p_text end
$$;

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
            message = format('invalid %s name %L', p_kind, pgque._name_for_message(p_name)),
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
        raise exception using errcode = 'PQ001', message = format('queue %L does not exist',
                                                          pgque._name_for_message(p_queue));
    end if;
    return v_queue;
end
$$;

-- pgque._event_table(queue_id, n): the name (without schema) of event table n
-- of a queue, or of the queue's parent table when n is null. Built from
-- integers only, so nothing a caller types reaches dynamic SQL.
create or replace function pgque._event_table(p_queue_id integer, p_n integer default null)
returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_n is null then
        return 'event_' || p_queue_id::text;
    end if;
    return 'event_' || p_queue_id::text || '_' || p_n::text;
end
$$;

-- pgque._current_cursor(sub_id): the subscription's current cursor state (the newest
-- row of its cursor log in the partition written now, read backwards along
-- the primary key: one index probe; during a switch, a second one in the
-- partition left for a subscription not moved yet; see ticker/rotation.sql). Every
-- subscription has one there; a statement whose snapshot predates the
-- rotations that emptied the partition it names finds none, and gets 40001
-- (_cursor_missing), unless not strict: then null, as for a subscription that
-- does not exist (a look before the receive lock, which reads it again).
create or replace function pgque._current_cursor(p_sub_id integer, p_strict boolean default true)
returns pgque.cursor
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_parts record := pgque._cursor_parts();
    v_cur pgque.cursor;
begin
    select * into v_cur from pgque.cursor
     where cur_part = v_parts.part and cur_sub = p_sub_id order by cur_seq desc limit 1;
    if not found and v_parts.moved_from is not null then
        -- Not moved yet by a switch in progress: its newest row is in the other.
        select * into v_cur from pgque.cursor
         where cur_part = v_parts.moved_from and cur_sub = p_sub_id
         order by cur_seq desc limit 1;
    end if;
    if not found and p_strict then
        perform pgque._cursor_missing(p_sub_id);
    end if;
    return v_cur;
end
$$;

-- pgque._cursor_missing(sub_id): called when subscription sub_id has no
-- cursor in the partition of the cursor log written now, as the caller's
-- snapshot sees it: raises 40001 (serialization failure) when the
-- subscription exists, for then that snapshot is older than a rotation that
-- emptied the partition it names (a REPEATABLE READ transaction, or a
-- statement that ran for longer than a rotation period): going on without
-- the cursor could judge a batch, a tick or an event table unneeded. A
-- subscription that is gone has no cursor; the caller goes on without one.
create or replace function pgque._cursor_missing(p_sub_id integer)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if exists (select from pgque.subscription s where s.sub_id = p_sub_id) then
        raise exception using errcode = '40001',
            message = 'pgque rotated its cursor tables after this statement''s snapshot',
            hint = 'Retry the transaction.';
    end if;
end
$$;

-- pgque._cursor_moved(): raises 40001 (serialization failure): a cursor
-- state this transaction was about to append is there already. Under the
-- receive lock a cursor is read by a new statement, so this happens only to
-- a REPEATABLE READ or SERIALIZABLE transaction whose snapshot predates
-- another session's receive or ack of the same subscription: it read the
-- cursor as it was before them. The writers append with ON CONFLICT DO
-- NOTHING, under which PostgreSQL itself raises 40001 for such a
-- transaction; this is for any other way to get there.
create or replace function pgque._cursor_moved()
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    raise exception using errcode = '40001',
        message = 'a pgque cursor moved after this transaction''s snapshot',
        hint = 'Retry the transaction.';
end
$$;

-- pgque._save_cursor(cursor): appends the next state of a cursor (whose
-- subscription row the caller holds locked); 40001 when a state of that
-- number is there already (_cursor_moved).
create or replace function pgque._save_cursor(p_cur pgque.cursor)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    insert into pgque.cursor (cur_sub, cur_seq, cur_last_tick, cur_batch, cur_next_tick,
                              cur_pos, cur_handed, cur_end, cur_part)
    values (p_cur.cur_sub, p_cur.cur_seq + 1, p_cur.cur_last_tick, p_cur.cur_batch,
            p_cur.cur_next_tick, p_cur.cur_pos, p_cur.cur_handed, p_cur.cur_end,
            pgque._write_part('cursor'))
    on conflict do nothing;
    if not found then
        perform pgque._cursor_moved();
    end if;
end
$$;

-- pgque._find_subscription(queue, consumer, lock): the subscription row of
-- consumer on queue (a row the caller looked up once) and its current cursor;
-- PQ002 when there is no such subscription. With lock, the subscription row is
-- taken FOR NO KEY UPDATE first: this is the receive lock that serializes a
-- consumer. (Not FOR UPDATE: that blocks the foreign-key checks of rows that
-- reference the subscription, such as the retries maintenance copies while it
-- holds the nack rotation's row, which a nack under this lock waits for: a
-- deadlock.) The cursor is read after it is granted (a new statement, so a fresh
-- snapshot). Without it, the cursor is null when a rotation emptied its
-- partition after this statement's snapshot (the callers look again, locked).
create or replace function pgque._find_subscription(
    p_queue pgque.queue, p_consumer text, p_lock boolean,
    out sub pgque.subscription, out cur pgque.cursor)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_lock then
        select * into sub from pgque.subscription s
         where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer
           for no key update;
    else
        select * into sub from pgque.subscription s
         where s.sub_queue = p_queue.queue_id and s.sub_consumer = p_consumer;
    end if;
    if not found then
        raise exception using
            errcode = 'PQ002',
            message = format('consumer %L is not subscribed to queue %L',
                             pgque._name_for_message(p_consumer), p_queue.queue_name);
    end if;
    -- Without the lock, a look that a rotation may outrun (see _current_cursor).
    cur := pgque._current_cursor(sub.sub_id, p_lock);
end
$$;

-- pgque._tick_snapshot(queue_id, tick_id): the snapshot stored by a tick.
create or replace function pgque._tick_snapshot(p_queue_id integer, p_tick_id bigint)
returns pg_snapshot
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select tick_snapshot from pgque.tick
             where tick_queue = p_queue_id and tick_id = p_tick_id);
end
$$;

-- pgque._random_key(): a fresh bigint for a session advisory lock key, from
-- the server's strong random source (gen_random_uuid), so that nobody can
-- guess the keys pgque's session locks use.
create or replace function pgque._random_key()
returns bigint
language sql volatile
set search_path = pg_catalog, pg_temp
as $$ select ('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8), 'hex'))::bit(64)::bigint $$;
