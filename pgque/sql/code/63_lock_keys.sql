-- pgque: session advisory lock keys.
--
-- Slot ownership, group membership and the ticker election are session
-- advisory locks on random bigint keys stored in pgque's tables (see
-- 65_partition.sql and 68_election.sql). These helpers find who holds a key.
-- pg_locks shows a bigint key k as classid = high 32 bits, objid = low 32
-- bits, objsubid = 1.

-- pgque._holds_key(key, mode): whether this session holds the bigint advisory
-- lock key in mode ('ExclusiveLock' or 'ShareLock'). Only an exclusive hold
-- of a slot's key is ownership: two share holders would both pass a
-- mode-blind check.
create or replace function pgque._holds_key(p_key bigint, p_mode text)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (
        select 1 from pg_locks
         where locktype = 'advisory' and pid = pg_backend_pid() and granted
           and classid = ((p_key >> 32) & 4294967295)::oid
           and objid = (p_key & 4294967295)::oid and objsubid = 1
           and mode = p_mode)
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

-- pgque._unlock_key(key, shared): releases every hold of this session on the
-- key in that mode; true when there was one. (Unlocking a lock not held makes
-- the server warn, hence the check.)
create or replace function pgque._unlock_key(p_key bigint, p_shared boolean)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_mode text := case when p_shared then 'ShareLock' else 'ExclusiveLock' end;
    v_released boolean := false;
begin
    while pgque._holds_key(p_key, v_mode) loop
        if p_shared then
            perform pg_advisory_unlock_shared(p_key);
        else
            perform pg_advisory_unlock(p_key);
        end if;
        v_released := true;
    end loop;
    return v_released;
end
$$;

-- pgque._session_role(): the login role of this session as other sessions see
-- it in pg_stat_activity, which is what they judge its locks by.
create or replace function pgque._session_role()
returns oid
language sql stable
set search_path = pg_catalog, pg_temp
as $$ select usesysid from pg_stat_activity where pid = pg_backend_pid() $$;
