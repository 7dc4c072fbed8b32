-- pgque: the ticker election.
--
-- Any number of tickers (pgque.Ticker, every Worker's, pg_cron's
-- ticker_loop) may run against a database; the active one holds a session
-- advisory lock on the install's random election key (pgque.ticker_election)
-- and the others stand by. The key is not published, but pg_locks shows it
-- while it is held, and advisory locks need no privilege: a role that may not
-- tick could wait on it and get it when the active ticker goes. So only
-- sessions of roles that may run claim_ticker count, and a claim that finds
-- the key held or awaited by no such session, only by others, renews it.
-- (The standbys' tick_overdue keeps delivery going meanwhile in any case.)


-- pgque._ticker_key(): the current election key.
create or replace function pgque._ticker_key()
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select te_key from pgque.ticker_election $$;

-- pgque._may_tick(role): whether sessions of role (an oid: a login role, as
-- pg_stat_activity shows it) count in the election: those whose role, or a
-- role they are members of, may run claim_ticker (admins, or roles granted it).
create or replace function pgque._may_tick(p_role oid)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select pgque._may_execute(p_role, to_regprocedure('pgque.claim_ticker()')) $$;

-- pgque.claim_ticker(): tries, without waiting, to become the active ticker
-- of the database; true when this session holds the election lock (also
-- when it already did). Renews the key first when only sessions that may not
-- tick hold or await it. False while a ticker elected by lease
-- (claim_ticker_lease) is active.
create or replace function pgque.claim_ticker()
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if not pgque._may_tick(pgque._session_role()) then
        raise exception using errcode = '42501',
            message = format('sessions of login role %s do not count in the ticker election',
                             pgque._session_role()::regrole),
            hint = 'The election judges sessions by their login role: grant the login role '
                   '(or a role it is a member of) pgque_admin.';
    end if;
    if not (pgque._holds_key(pgque._ticker_key()) or pgque._take_key('ticker', null)) then
        return false;
    end if;
    -- A ticker elected by lease (below) is active: stand by.
    if exists (select 1 from pgque.ticker_election where te_lease_until > clock_timestamp()) then
        perform pgque._unlock_key(pgque._ticker_key());
        return false;
    end if;
    return true;
end
$$;

-- pgque.claim_ticker_lease(token, name, lease): the election for a ticker
-- behind a transaction pooler, where a session lock means nothing: true when
-- the caller (named by token, 32 to 64 characters of its own choosing, and
-- name) is the active ticker until lease from now (1 second to 1 hour), by
-- taking a lease no other live ticker holds, or renewing its own; false while
-- another ticker holds a live lease or the advisory lock (claim_ticker). Call
-- it again within the lease to stay active. (Two tickers may briefly both be
-- active when a claim of each kind runs at once: ticks of a queue are
-- serialized, so that costs a duplicate look, nothing else.) 42501 for roles
-- that may not tick; 22023 for a bad token, name or lease.
create or replace function pgque.claim_ticker_lease(p_token text, p_name text, p_lease interval)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    if not pgque._may_tick(pgque._session_role()) then
        raise exception using errcode = '42501',
            message = format('sessions of login role %s do not count in the ticker election',
                             pgque._session_role()::regrole),
            hint = 'The election judges sessions by their login role: grant the login role '
                   '(or a role it is a member of) pgque_admin.';
    end if;
    if p_token is null or length(p_token) not between 32 and 64
       or p_name is null or length(p_name) not between 1 and 200
       or p_lease is null or p_lease not between interval '1 second' and interval '1 hour' then
        raise exception using errcode = '22023',
            message = 'a ticker lease needs a token of 32 to 64 characters, a name of 1 to 200 '
                      'and a lease time of 1 second to 1 hour';
    end if;
    if pgque.active_ticker() is not null then
        return false;  -- elected by advisory lock
    end if;
    update pgque.ticker_election
       set te_lease_token = p_token, te_lease_name = p_name,
           te_lease_until = clock_timestamp() + p_lease
     where te_lease_token = p_token
        or te_lease_until is null or te_lease_until <= clock_timestamp();
    return found;
end
$$;

-- pgque.release_ticker_lease(token): gives up the election by lease if token
-- holds it; true when it did.
create or replace function pgque.release_ticker_lease(p_token text)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
begin
    update pgque.ticker_election
       set te_lease_token = null, te_lease_name = null, te_lease_until = null
     where te_lease_token = p_token and p_token is not null;
    return found;
end
$$;

-- pgque.ticker_lease(): the name of the ticker elected by lease and when its
-- lease ends, if it has not ended; no row otherwise.
create or replace function pgque.ticker_lease(out name text, out lease_until timestamptz)
returns setof record
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select te_lease_name, te_lease_until from pgque.ticker_election
     where te_lease_until > clock_timestamp()
$$;

-- pgque.release_ticker(): gives up the election if this session holds it;
-- true when it did.
create or replace function pgque.release_ticker()
returns boolean
language sql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._unlock_key(pgque._ticker_key()) $$;

-- pgque.active_ticker(): the backend pid of the active ticker, or null. Only
-- sessions that may tick count.
create or replace function pgque.active_ticker()
returns integer
language sql volatile
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select k.pid from pgque._key_sessions(pgque._ticker_key()) k
     where k.granted and k.mode = 'ExclusiveLock' and pgque._may_tick(k.role)
     limit 1
$$;
