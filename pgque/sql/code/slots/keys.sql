-- pgque: session advisory lock keys.
--
-- Slot ownership and the ticker election are exclusive session advisory
-- locks on random bigint keys stored in pgque's tables (see slots/groups.sql
-- and ticker/election.sql; group membership, which uses keys of two integers, is
-- there too). These helpers take, check and release such keys and find who
-- holds one. pg_locks shows a bigint key k as classid = high 32 bits, objid
-- = low 32 bits, objsubid = 1.

-- Every key pgque takes, it takes twice (_take_key here; member keys in
-- slots/groups.sql, epoch keys in slots/fence.sql): a session lock is
-- re-entrant, and while a session holds a key more than once, giving one hold
-- back and taking it again is bookkeeping in the session's own memory that
-- never reaches the server's lock table. That is what lets _holds_key ask the
-- lock manager without ever releasing the key: a release that reached the
-- lock table would grant the key at once to any session waiting on it, and
-- pg_locks shows held keys to every role.

-- pgque._holds_key(key): whether this session holds the bigint advisory lock
-- key exclusively at session level (a shared hold is not ownership: two
-- share holders would both pass).
--
-- It gives one hold back and takes it again: the release succeeds exactly
-- when the session holds the key, and with pgque's two holds both steps stay
-- in the session's memory (see above), so no waiter gets the key in between
-- and the answer costs no look at the server's lock table (pg_locks copies
-- all of it, ~0.3 ms, on every receive and ack). A key held once only (taken
-- by hand, or by pgque 0.2 before an upgrade) is released and taken again
-- for real: another session may get it in between, and the answer is then
-- false, the truth, never the reverse. The release warns when there is no
-- hold, hence the client_min_messages. A transaction-level hold
-- (pg_advisory_xact_lock) is not ownership: claims take session locks.
create or replace function pgque._holds_key(p_key bigint)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
begin
    -- Two statements, not one AND: SQL does not promise to evaluate the
    -- release first, nor to skip the take when the release finds no hold.
    if not pg_advisory_unlock(p_key) then
        return false;
    end if;
    return pg_try_advisory_lock(p_key);
end
$$;

-- pgque._holds_pair(key1, key2): _holds_key for a two-integer key (a group
-- member's, slots/groups.sql, or an epoch's, slots/fence.sql).
create or replace function pgque._holds_pair(p_key1 integer, p_key2 integer)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
begin
    if not pg_advisory_unlock(p_key1, p_key2) then
        return false;
    end if;
    return pg_try_advisory_lock(p_key1, p_key2);
end
$$;

-- pgque._own_pair_numbers(key1): the second integers of the two-integer
-- advisory keys (key1, n) this session holds exclusively in this database,
-- signed as the advisory functions take them (pg_locks shows them unsigned).
-- One read of pg_locks: for the rare paths that must find a key whose setting
-- a rollback lost (slots/groups.sql, slots/fence.sql), never per receive.
create or replace function pgque._own_pair_numbers(p_key1 integer)
returns setof integer
language sql volatile
set search_path = pg_catalog, pg_temp
as $$
    select ((l.objid::bigint + 2147483648) % 4294967296 - 2147483648)::integer
      from pg_locks l
     where l.locktype = 'advisory' and l.objsubid = 2 and l.pid = pg_backend_pid()
       and l.granted and l.mode = 'ExclusiveLock'
       and l.classid = (p_key1::bigint & 4294967295)::oid
       and l.database = (select oid from pg_database where datname = current_database())
$$;

-- pgque._key_sessions(key): every lock on the bigint advisory key in this
-- database, held or awaited: the session's pid (null for a prepared
-- transaction), its login role, the mode and whether it is granted. The
-- activity snapshot is taken anew (PostgreSQL keeps one per transaction), so
-- a session that started since the transaction began is known too.
create or replace function pgque._key_sessions(p_key bigint)
returns table (pid integer, role oid, mode text, granted boolean)
language sql volatile
set search_path = pg_catalog, pg_temp
as $$
    select pg_stat_clear_snapshot();
    select l.pid, a.usesysid, l.mode, l.granted
      from pg_locks l
      left join pg_stat_activity a on a.pid = l.pid
     where l.locktype = 'advisory' and l.objsubid = 1
       and l.database = (select oid from pg_database where datname = current_database())
       and l.classid = ((p_key >> 32) & 4294967295)::oid
       and l.objid = (p_key & 4294967295)::oid
$$;

-- pgque._unlock_key(key): releases every exclusive hold of this session on
-- the bigint key; true when there was one. (Unlocking a lock not held makes
-- the server warn, hence the client_min_messages.)
create or replace function pgque._unlock_key(p_key bigint)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
declare
    v_released boolean := false;
begin
    while pg_advisory_unlock(p_key) loop
        v_released := true;
    end loop;
    return v_released;
end
$$;

-- pgque._session_role(): the login role of this session as other sessions see
-- it in pg_stat_activity, which is what they judge its locks by.
create or replace function pgque._session_role()
returns oid
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select usesysid from pg_stat_activity where pid = pg_backend_pid());
end
$$;

-- pgque._current_key(kind, id): the current key of a slot ('slot', its sub_id)
-- or of the ticker election ('ticker', id ignored).
create or replace function pgque._current_key(p_kind text, p_id integer)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return case p_kind
        when 'slot' then (select s.sub_lock_key from pgque.subscription s where s.sub_id = p_id)
        else (select e.te_key from pgque.ticker_election e)
    end;
end
$$;

-- pgque._counts_on_key(kind, role, queue, group): whether sessions of login
-- role (an oid) count on such a key: for a slot, if the role may use the
-- group; for the election, if it may tick.
create or replace function pgque._counts_on_key(
    p_kind text, p_role oid, p_queue pgque.queue, p_group pgque.consumer_group)
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_kind = 'ticker' then
        return pgque._may_tick(p_role);
    end if;
    return pgque._may_consume(p_role, p_queue, p_group.cg_owner, p_group.cg_grantees);
end
$$;

-- pgque._take_key(kind, id, queue, group): tries, without waiting, to take
-- the exclusive session lock on the current key of a slot or the election
-- (see _current_key); true when this session now holds it, twice (see the
-- top of this file). When the key is held or awaited only by sessions that
-- do not count (_counts_on_key), and by no counting session, it draws a new
-- key and tries that: pg_locks shows keys to everyone, and advisory locks
-- need no privilege. A lock taken on a key that a concurrent caller renewed
-- meanwhile is let go: it owns nothing.
create or replace function pgque._take_key(
    p_kind text, p_id integer,
    p_queue pgque.queue default null, p_group pgque.consumer_group default null)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key bigint := pgque._current_key(p_kind, p_id);
    v_now bigint;
begin
    for attempt in 1 .. 3 loop
        if pg_try_advisory_lock(v_key) then
            v_now := pgque._current_key(p_kind, p_id);
            if v_now = v_key then
                -- The second hold: re-entrant, so it is granted at once.
                return pg_try_advisory_lock(v_key);
            end if;
            perform pgque._unlock_key(v_key);
            v_key := v_now;
            continue;
        end if;
        exit when not exists (
                     select 1 from pgque._key_sessions(v_key) k
                      where not pgque._counts_on_key(p_kind, k.role, p_queue, p_group))
               or exists (
                     select 1 from pgque._key_sessions(v_key) k
                      where k.granted and k.mode = 'ExclusiveLock'
                        and pgque._counts_on_key(p_kind, k.role, p_queue, p_group));
        -- Only where the key is still the one seen: one renewal per round.
        if p_kind = 'slot' then
            update pgque.subscription set sub_lock_key = pgque._random_key()
             where sub_id = p_id and sub_lock_key = v_key;
        else
            update pgque.ticker_election set te_key = pgque._random_key()
             where te_key = v_key;
        end if;
        v_key := pgque._current_key(p_kind, p_id);
    end loop;
    return false;
end
$$;
