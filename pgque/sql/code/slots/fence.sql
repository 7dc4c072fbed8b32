-- pgque: fencing epochs for slot owners.
--
-- The slot's advisory lock keeps two sessions from receiving or acking one
-- slot at once, but a handler writing over another connection (or to another
-- system) can outlive the session that owns its slot: a frozen process, a
-- lost network. Epochs fence such a zombie out. When a slot passes to a
-- session, the session's first receive takes a new epoch (pgque.epoch_seq:
-- it only grows) and every batch of that ownership carries it. A handler
-- calls pgque.check_fence(queue, consumer, slot, epoch) in the transaction
-- that writes its effects: it raises PQ026 unless the epoch is the slot's
-- current one and the session that took it still holds the slot.
--
-- The check share-locks the slot's pgque.slot_claim row until the checking
-- transaction ends, and a new epoch is taken by updating that row, so a new
-- owner receives nothing until every transaction that checked the old epoch
-- has ended: writes fenced by epoch e all commit (or fail) before any event is
-- handed out under a later epoch. The new owner does not wait for them (a
-- wait as long as a handler's transaction would look like a dead network to a
-- client's watchdog): while the row is locked, its receive returns nothing,
-- as when no batch is ready, and it tries again at its next poll.

-- Who holds an epoch: the session that took it holds it as an advisory lock,
-- the epoch key (two integers: _epoch_class(slot), the epoch's low 32 bits),
-- taken twice (see slots/keys.sql) when it takes the epoch and released
-- with the slot. So "pid P holds epoch key K and the slot's key" names one
-- session and one ownership: pids are reused, but the key dies with the
-- session, and a release ends it even when the release's transaction rolls
-- back or a checking transaction keeps the epoch's row from being updated.
-- Any session may check it in pg_locks. (0.2 named the session by its
-- backend's start time, which pg_stat_activity hides from roles without
-- pg_read_all_stats, which the database owner who installs pgque usually
-- lacks: every receive then took a new epoch, and no fence passed.)

-- pgque._new_epoch(): a new epoch: the epochs' generation times 2^40, plus
-- the next value of pgque.epoch_seq. The generation (pgque.epoch_generation)
-- is the highest timeline the server has written on when it took an epoch:
-- a standby promoted after a failover writes on a timeline above the old
-- primary's, so every epoch it hands out is above every epoch of the old one,
-- including those the old one handed out after its last replicated write, or
-- would hand out if it came back as a primary (which a failover manager must
-- prevent): a system outside PostgreSQL that keeps the highest epoch seen per
-- slot refuses the old side's writes. A pg_upgrade or a restore starts on
-- timeline 1 again; the stored generation keeps the epochs growing. The low
-- 32 bits, the epoch's key (_epoch_number), are the sequence's.
create or replace function pgque._new_epoch()
returns bigint
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_timeline bigint := ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint;
    v_generation bigint;
begin
    select eg_generation into v_generation from pgque.epoch_generation;
    if v_generation is null or v_timeline > v_generation then
        -- Once per timeline: the first epoch after a failover (or the install).
        insert into pgque.epoch_generation (eg_generation) values (v_timeline)
        on conflict (eg_single) do update set eg_generation = greatest(
            pgque.epoch_generation.eg_generation, excluded.eg_generation)
        returning eg_generation into v_generation;
    end if;
    return (v_generation << 40) + nextval('pgque.epoch_seq');
end
$$;

-- pgque._epoch_class(sub_id): the first integer of a slot's epoch keys: the
-- negated subscription id, never a group's member class (slots/groups.sql,
-- never negative).
create or replace function pgque._epoch_class(p_sub_id integer)
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select -p_sub_id $$;

-- pgque._epoch_number(epoch): the second integer of an epoch's key: its low
-- 32 bits, as a signed integer.
create or replace function pgque._epoch_number(p_epoch bigint)
returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select ((p_epoch + 2147483648) % 4294967296 - 2147483648)::integer $$;

-- pgque._drop_epoch_keys(sub_id): releases every epoch key of the slot this
-- session holds (found in pg_locks: a rolled back epoch leaves its key held
-- with no row naming it). Called where an ownership or an epoch ends, not per
-- receive.
create or replace function pgque._drop_epoch_keys(p_sub_id integer)
returns void
language plpgsql volatile
set search_path = pg_catalog, pg_temp
set client_min_messages = error
as $$
declare
    v_class integer := pgque._epoch_class(p_sub_id);
    v_number integer;
begin
    for v_number in select n from pgque._own_pair_numbers(v_class) n loop
        while pg_advisory_unlock(v_class, v_number) loop
        end loop;
    end loop;
end
$$;

-- pgque._holds_epoch(pid, sub_id, epoch, key): whether the session pid holds
-- the epoch's key and the slot's key (key) exclusively: on this session's own
-- locks when it is this one (no look at pg_locks), else in pg_locks (one read).
create or replace function pgque._holds_epoch(
    p_pid integer, p_sub_id integer, p_epoch bigint, p_key bigint)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_pid is null or p_epoch is null then
        return false;
    end if;
    if p_pid = pg_backend_pid() then
        return pgque._holds_pair(pgque._epoch_class(p_sub_id), pgque._epoch_number(p_epoch))
           and pgque._holds_key(p_key);
    end if;
    return (select count(*) = 2 from pg_locks l
             where l.locktype = 'advisory' and l.pid = p_pid
               and l.granted and l.mode = 'ExclusiveLock'
               and l.database = (select oid from pg_database where datname = current_database())
               and ((l.objsubid = 2
                     and l.classid = (pgque._epoch_class(p_sub_id)::bigint & 4294967295)::oid
                     and l.objid = (pgque._epoch_number(p_epoch)::bigint & 4294967295)::oid)
                    or (l.objsubid = 1
                        and l.classid = ((p_key >> 32) & 4294967295)::oid
                        and l.objid = (p_key & 4294967295)::oid)));
end
$$;

-- pgque._held_epoch(sub): the slot's current epoch when this session took it
-- in its current ownership of the slot, else null. No wait, no write, no look
-- at pg_locks. With a lease (slots/lease.sql): the epoch of the slot's claim
-- when it names the caller's lease.
create or replace function pgque._held_epoch(p_sub pgque.subscription)
returns bigint
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
declare
    v_epoch bigint;
begin
    if current_setting('pgque.lease', true) <> '' then  -- by lease: the claim took it
        return (select c.sc_epoch from pgque.slot_claim c
                 where c.sc_sub = p_sub.sub_id and c.sc_lease = pgque._lease_id());
    end if;
    select c.sc_epoch into v_epoch from pgque.slot_claim c
     where c.sc_sub = p_sub.sub_id and c.sc_pid = pg_backend_pid();
    if v_epoch is not null
       and pgque._holds_pair(pgque._epoch_class(p_sub.sub_id), pgque._epoch_number(v_epoch)) then
        return v_epoch;
    end if;
    return null;
end
$$;

-- pgque._slot_epoch(sub): the slot's epoch for this session, which owns the
-- slot: the current one when this session took it (_held_epoch), else a new
-- one, whose key it takes; null while a transaction that checked the old one
-- holds it (see above).
create or replace function pgque._slot_epoch(p_sub pgque.subscription)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_claim pgque.slot_claim;
begin
    v_claim.sc_epoch := pgque._held_epoch(p_sub);
    if v_claim.sc_epoch is not null or current_setting('pgque.lease', true) <> '' then
        return v_claim.sc_epoch;  -- the usual case: one look; by lease, the claim's
    end if;
    select * into v_claim from pgque.slot_claim where sc_sub = p_sub.sub_id;
    if found then
        perform 1 from pgque.slot_claim where sc_sub = p_sub.sub_id
            for no key update skip locked;
        if not found then
            return null;  -- held by a checking transaction
        end if;
    end if;
    -- A first row of the slot, or the row locked above. (Two sessions cannot
    -- both get here for one slot: only its owner receives.)
    insert into pgque.slot_claim (sc_sub, sc_epoch, sc_pid)
    values (p_sub.sub_id, pgque._new_epoch(), pg_backend_pid())
    on conflict (sc_sub) do update
       set sc_epoch = excluded.sc_epoch, sc_pid = excluded.sc_pid, sc_time = now()
    returning sc_epoch into v_claim.sc_epoch;
    perform pgque._drop_epoch_keys(p_sub.sub_id);  -- an earlier epoch's, rolled back
    perform pg_try_advisory_lock(pgque._epoch_class(p_sub.sub_id),
                                 pgque._epoch_number(v_claim.sc_epoch));
    perform pg_try_advisory_lock(pgque._epoch_class(p_sub.sub_id),
                                 pgque._epoch_number(v_claim.sc_epoch));  -- the second hold
    return v_claim.sc_epoch;
end
$$;

-- pgque._slot_epochs(subs): _slot_epoch for each of subs (slots this session
-- owns), in their order. The usual case, every slot's epoch taken by this
-- session already, is one statement; otherwise slot by slot.
create or replace function pgque._slot_epochs(p_subs pgque.subscription[])
returns bigint[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_epochs bigint[];
begin
    if current_setting('pgque.lease', true) <> '' then  -- by lease (_lease_token)
        return array(select pgque._held_epoch(p_subs[i]) from generate_subscripts(p_subs, 1) i
                      order by i);
    end if;
    select array_agg(c.sc_epoch order by t.ordinality) into v_epochs
      from unnest(p_subs) with ordinality as t
      join pgque.slot_claim c on c.sc_sub = t.sub_id
     where c.sc_pid = pg_backend_pid()
       and pgque._holds_pair(pgque._epoch_class(c.sc_sub), pgque._epoch_number(c.sc_epoch));
    if cardinality(v_epochs) = cardinality(p_subs) then
        return v_epochs;
    end if;
    return array(select pgque._slot_epoch(p_subs[i]) from generate_subscripts(p_subs, 1) i
                  order by i);
end
$$;

-- pgque._end_epoch(sub): called when this session releases the slot: its
-- epoch ends, so the next claim (even by this session) takes a new one. The
-- epoch's key goes at once, whatever becomes of this transaction; the row is
-- marked released unless a checking transaction holds it (no wait: check_fence
-- refuses the epoch anyway once its key is gone).
create or replace function pgque._end_epoch(p_sub pgque.subscription)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if pgque._lease_token() is not null then
        -- By lease the claim is the ownership: it must say the slot is free,
        -- so this waits for a transaction that checked the epoch.
        update pgque.slot_claim c set sc_lease = null, sc_time = now()
         where c.sc_sub = p_sub.sub_id and c.sc_lease = pgque._lease_id();
        return;
    end if;
    perform pgque._drop_epoch_keys(p_sub.sub_id);
    update pgque.slot_claim c set sc_pid = null, sc_time = now()
     where c.sc_sub = p_sub.sub_id and c.sc_pid = pg_backend_pid()
       and c.sc_sub in (select l.sc_sub from pgque.slot_claim l where l.sc_sub = p_sub.sub_id
                           for no key update skip locked);
end
$$;

-- pgque.check_fence(queue, consumer, slot, epoch): returns when epoch is the
-- current epoch of slot slot of consumer group consumer and the session that
-- took it still owns the slot; raises PQ026 otherwise (a stale epoch: the
-- slot moved, was released, or its owner's session ended). Call it in the
-- transaction that writes a handler's effects, on any connection: it holds
-- the epoch until that transaction ends (see above). For a group that owns
-- by lease (slots/lease.sql), the lease that took the epoch must still name
-- the slot and not have expired by the database's clock at the check. PQ014
-- for a role that may not use the group; 22023 for a null epoch.
create or replace function pgque.check_fence(
    p_queue text, p_consumer text, p_slot integer, p_epoch bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_claim pgque.slot_claim;
begin
    if p_epoch is null then
        raise exception using errcode = '22023', message = 'the epoch must not be null';
    end if;
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    select * into v_claim from pgque.slot_claim where sc_sub = (v.sub).sub_id for share;
    if not found or v_claim.sc_epoch <> p_epoch then
        raise exception using errcode = 'PQ026',
            message = format('epoch %s of slot %L is stale: the slot''s epoch is now %s',
                             p_epoch, (v.sub).sub_consumer,
                             coalesce(v_claim.sc_epoch::text, 'none')),
            hint = 'The slot passed to another owner: this handler must not write its effects.';
    end if;
    if (v.grp).cg_lease is not null then
        -- By lease: the claim still names a lease that has not expired.
        if not pgque._lease_alive(v_claim.sc_lease, v.queue, v.grp) then
            raise exception using errcode = 'PQ026',
                message = format('epoch %s of slot %L is stale: the lease that took it '
                                 'expired or was released', p_epoch, (v.sub).sub_consumer),
                hint = 'The owner''s lease ended: this handler must not write its effects.';
        end if;
        return;
    end if;
    if not pgque._holds_epoch(v_claim.sc_pid, (v.sub).sub_id, v_claim.sc_epoch,
                              (v.sub).sub_lock_key) then
        raise exception using errcode = 'PQ026',
            message = format('epoch %s of slot %L is stale: the session that took it no '
                             'longer owns the slot', p_epoch, (v.sub).sub_consumer),
            hint = 'The owner''s session ended or released the slot: this handler must not '
                   'write its effects.';
    end if;
end
$$;
