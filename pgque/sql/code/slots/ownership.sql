-- pgque: slot ownership: claiming and releasing a slot, and the owner check.

-- pgque.slot_lock_key(queue, consumer, slot): the bigint key of the session
-- advisory lock that owns the slot now (random per slot; claim_slot may
-- renew it, so do not keep it). Refused (PQ014) to roles that may not use
-- the group; PQ035 for a group that owns by lease (its slots have no key).
create or replace function pgque.slot_lock_key(p_queue text, p_consumer text, p_slot integer)
returns bigint
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    if (v.grp).cg_lease is not null then
        raise exception using errcode = 'PQ035',
            message = format('consumer group %L of queue %L owns its slots by lease: they have '
                             'no lock key', p_consumer, (v.queue).queue_name);
    end if;
    return (v.sub).sub_lock_key;
end
$$;

-- pgque._require_counting_session(queue, group): PQ014 unless the locks of
-- this session will count for the group, i.e. unless its login role (not only
-- the role it SETs) may use the group: otherwise it could hold a slot's lock
-- that nobody counts, and lose the slot to the next claim.
create or replace function pgque._require_counting_session(
    p_queue pgque.queue, p_group pgque.consumer_group)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_login oid := pgque._session_role();
begin
    if not pgque._may_consume(v_login, p_queue, p_group.cg_owner, p_group.cg_grantees) then
        raise exception using errcode = 'PQ014',
            message = format('sessions of login role %s do not count in group %L of queue %L',
                             v_login::regrole, p_group.cg_consumer, p_queue.queue_name),
            hint = 'Slot owners and members are judged by their login role: grant the login '
                   'role (or a role it is a member of) the group and pgque_reader.';
    end if;
end
$$;

-- pgque._holds_slot(sub): whether this session holds the slot's lock
-- exclusively; for a call with a lease (slots/lease.sql), whether the slot's
-- claim names the caller's lease, which has not expired (PQ034 when it has).
create or replace function pgque._holds_slot(p_sub pgque.subscription)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if current_setting('pgque.lease', true) <> '' then  -- by lease (lease.sql): PQ034 once expired
        return exists (select 1 from pgque.slot_claim c
                        where c.sc_sub = p_sub.sub_id and c.sc_lease = pgque._lease_id());
    end if;
    -- A slot of a group that owns by lease has no key (set_ownership): no lock
    -- taken by hand on an old one owns it.
    return p_sub.sub_lock_key is not null and pgque._holds_key(p_sub.sub_lock_key);
end
$$;

-- pgque._slot_owned(queue, group, sub): whether anyone owns the slot now: a
-- session of a role that may use the group holding its lock, or, for a group
-- that owns by lease, a live lease its claim names. Any session may ask.
create or replace function pgque._slot_owned(
    p_queue pgque.queue, p_group pgque.consumer_group, p_sub pgque.subscription)
returns boolean
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if p_group.cg_lease is not null then
        return exists (select 1 from pgque.slot_claim c
                        where c.sc_sub = p_sub.sub_id
                          and pgque._lease_alive(c.sc_lease, p_queue, p_group));
    end if;
    return exists (select 1 from pgque._key_sessions(p_sub.sub_lock_key) k
                    where k.granted and k.mode = 'ExclusiveLock'
                      and pgque._may_consume(k.role, p_queue, p_group.cg_owner,
                                             p_group.cg_grantees));
end
$$;

-- pgque._require_owner(sub): PQ024 unless this session holds the slot's lock.
create or replace function pgque._require_owner(p_sub pgque.subscription)
returns void
language plpgsql volatile
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._holds_slot(p_sub) then
        raise exception using errcode = 'PQ024',
            message = format('this session does not own slot %L', p_sub.sub_consumer),
            hint = 'Claim the slot first (pgque.claim_slot); a session that lost its lock '
                   'must not receive or ack for the slot.';
    end if;
end
$$;

-- pgque.claim_slot(queue, consumer, slot): tries, without waiting, to take
-- the slot's session advisory lock; true when this session now holds it
-- (also when it already did; the lock is never taken twice). When the key is
-- held or awaited only by sessions whose roles may not use the group, the
-- key is renewed first (see the top of this file), so such a session cannot
-- keep a slot from its workers. Refused (PQ014) to roles that may not use
-- the group. For a group that owns by lease, the call carries a lease
-- (slots/lease.sql, PQ035 otherwise) and claims the slot for it: true when
-- no other live lease holds it; each claim that moves the slot takes a new
-- epoch.
create or replace function pgque.claim_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
    v_group pgque.consumer_group;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    perform pgque._require_counting_session(v.queue, v.grp);
    -- The group's mode, read under a lock that set_ownership waits for.
    select * into v_group from pgque.consumer_group where cg_id = (v.grp).cg_id for key share;
    perform pgque._require_mode(v.queue, v_group);
    if v_group.cg_lease is not null then
        return pgque._claim_by_lease(v.sub, v.queue, v_group);
    end if;
    return pgque._holds_slot(v.sub)
        or pgque._take_key('slot', (v.sub).sub_id, v.queue, v_group);
end
$$;

-- pgque.release_slot(queue, consumer, slot): releases the slot's lock if
-- this session holds it, ending its epoch first (see slots/fence.sql); true when
-- it did. With a lease: the claim of the caller's lease ends (PQ034 once the
-- lease expired).
create or replace function pgque.release_slot(p_queue text, p_consumer text, p_slot integer)
returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v record;
begin
    select * into v from pgque._slot_sub(p_queue, p_consumer, p_slot, null, false);
    if pgque._lease_token() is not null then
        perform pgque._require_mode(v.queue, v.grp);
        if pgque._holds_slot(v.sub) then
            perform pgque._end_epoch(v.sub);
            return true;
        end if;
        return false;
    end if;
    if pgque._holds_slot(v.sub) then
        perform pgque._end_epoch(v.sub);
    end if;
    return pgque._unlock_key((v.sub).sub_lock_key);
end
$$;
