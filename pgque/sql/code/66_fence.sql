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

-- pgque._backend_start(pid): when the backend with that pid started; with the
-- pid it names one session (pids are reused).
create or replace function pgque._backend_start(p_pid integer)
returns timestamptz
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select a.backend_start from pg_stat_get_activity(p_pid) a);
end
$$;

-- pgque._held_epoch(sub): the slot's current epoch when this session took
-- it, else null. Reads only: no wait, no write.
create or replace function pgque._held_epoch(p_sub pgque.subscription)
returns bigint
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select c.sc_epoch from pgque.slot_claim c
             where c.sc_sub = p_sub.sub_id and c.sc_pid = pg_backend_pid()
               and c.sc_backend_start = pgque._backend_start(pg_backend_pid()));
end
$$;

-- pgque._slot_epoch(sub): the slot's epoch for this session, which owns the
-- slot: the current one when this session took it (_held_epoch), else a new
-- one; null while a transaction that checked the old one holds it (see above).
create or replace function pgque._slot_epoch(p_sub pgque.subscription)
returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_claim pgque.slot_claim;
begin
    v_claim.sc_epoch := pgque._held_epoch(p_sub);
    if v_claim.sc_epoch is not null then
        return v_claim.sc_epoch;  -- the usual case: one look, one _backend_start
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
    insert into pgque.slot_claim (sc_sub, sc_epoch, sc_pid, sc_backend_start)
    values (p_sub.sub_id, nextval('pgque.epoch_seq'), pg_backend_pid(),
            pgque._backend_start(pg_backend_pid()))
    on conflict (sc_sub) do update
       set sc_epoch = excluded.sc_epoch, sc_pid = excluded.sc_pid,
           sc_backend_start = excluded.sc_backend_start, sc_time = now()
    returning sc_epoch into v_claim.sc_epoch;
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
    v_start timestamptz := pgque._backend_start(pg_backend_pid());
    v_epochs bigint[];
begin
    select array_agg(c.sc_epoch order by t.ordinality) into v_epochs
      from unnest(p_subs) with ordinality as t
      join pgque.slot_claim c on c.sc_sub = t.sub_id
     where c.sc_pid = pg_backend_pid() and c.sc_backend_start = v_start;
    if cardinality(v_epochs) = cardinality(p_subs) then
        return v_epochs;
    end if;
    return array(select pgque._slot_epoch(p_subs[i]) from generate_subscripts(p_subs, 1) i
                  order by i);
end
$$;

-- pgque._end_epoch(sub): called when this session releases the slot: its
-- epoch ends, so the next claim (even by this session) takes a new one. It
-- does not wait: while a checking transaction holds the epoch, the epoch stays
-- (check_fence refuses it anyway once the slot is released, as nobody holds
-- the slot under it), and only a claim by this same session would take it up
-- again.
create or replace function pgque._end_epoch(p_sub pgque.subscription)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    update pgque.slot_claim c set sc_pid = null, sc_time = now()
     where c.sc_sub = p_sub.sub_id and c.sc_pid = pg_backend_pid()
       and c.sc_sub in (select l.sc_sub from pgque.slot_claim l where l.sc_sub = p_sub.sub_id
                           for no key update skip locked)
$$;

-- pgque.check_fence(queue, consumer, slot, epoch): returns when epoch is the
-- current epoch of slot slot of consumer group consumer and the session that
-- took it still owns the slot; raises PQ026 otherwise (a stale epoch: the
-- slot moved, was released, or its owner's session ended). Call it in the
-- transaction that writes a handler's effects, on any connection: it holds
-- the epoch until that transaction ends (see above). PQ014 for a role that
-- may not use the group; 22023 for a null epoch.
create or replace function pgque.check_fence(
    p_queue text, p_consumer text, p_slot integer, p_epoch bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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
    if v_claim.sc_pid is null or not exists (
           select 1 from pgque._key_sessions((v.sub).sub_lock_key) k
            where k.pid = v_claim.sc_pid and k.granted and k.mode = 'ExclusiveLock'
              and pgque._backend_start(k.pid) = v_claim.sc_backend_start) then
        raise exception using errcode = 'PQ026',
            message = format('epoch %s of slot %L is stale: the session that took it no '
                             'longer owns the slot', p_epoch, (v.sub).sub_consumer),
            hint = 'The owner''s session ended or released the slot: this handler must not '
                   'write its effects.';
    end if;
end
$$;
