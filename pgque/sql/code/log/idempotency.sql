-- pgque: idempotency keys: a send that happens once however often it is retried.
--
-- A send with an idempotency key records the key with the id of the event it
-- sends, in pgque.idempotency_key, in the sender's transaction: a rolled-back
-- send leaves no key. For the queue's idempotency window (queue setting
-- idempotency_window, 24 hours by default) a send of the same key writes
-- nothing and returns that id, as a duplicate. Two senders of one key at once
-- meet on the table's primary key: the second waits for the first to commit
-- or roll back, then takes the first's id or sends its own.
--
-- The table rotates (rotation.sql, _rotate_idempotency): written one
-- partition at a time, the one not written is emptied once every key in it is
-- older than the longest window, then the writes switch to it. The primary
-- key is per partition, so a switch must not come between two senders of a
-- key: each sender takes the table in ROW EXCLUSIVE mode before it reads which
-- partition to write, and holds it to its commit, and a switch takes the
-- table in SHARE mode, which waits for no sender (it tries without queueing)
-- and is granted only when none is in flight. A REPEATABLE READ or
-- SERIALIZABLE sender, whose snapshot may predate a switch, share-locks the
-- rotation row, which fails with 40001 when a switch committed since.

-- pgque._check_idempotency_keys(keys): raises PQ032 unless every non-null key
-- is 1 to 512 bytes long.
create or replace function pgque._check_idempotency_keys(p_keys text[])
returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_bad integer;
begin
    select i into v_bad
      from unnest(p_keys) with ordinality as k(key, i)
     where octet_length(k.key) = 0 or octet_length(k.key) > 512
     order by i
     limit 1;
    if v_bad is not null then
        raise exception using errcode = 'PQ032',
            message = format('idempotency key %s is %s', v_bad,
                             case when octet_length(p_keys[v_bad]) = 0 then 'empty'
                                  else 'longer than 512 bytes' end);
    end if;
end
$$;

-- pgque._idempotency_part(): the partition of pgque.idempotency_key to write
-- now, after taking the table in ROW EXCLUSIVE mode until the transaction ends
-- (see the top of this file): two statements, so that in READ COMMITTED the
-- read sees a switch that the lock waited for.
create or replace function pgque._idempotency_part()
returns smallint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    lock table only pgque.idempotency_key in row exclusive mode;
    if current_setting('transaction_isolation') <> 'read committed' then
        -- 40001 when a switch committed after this transaction's snapshot.
        return (select r.rt_part from pgque.rotation r where r.rt_name = 'idempotency'
                   for share);
    end if;
    return (select r.rt_part from pgque.rotation r where r.rt_name = 'idempotency');
end
$$;

-- pgque._claim_idempotency_key(queue, part, key, id, due, now): records key
-- in partition part (from _idempotency_part) for an event sent at now with
-- id and due time due, unless the key has an unexpired record; returns the
-- record's event id and due time and duplicate true then, else id, due and
-- false. A sender of the key in flight makes this wait for its end; an
-- expired record in this partition is replaced in place. 40001 when the key
-- keeps changing under it (three rounds).
create or replace function pgque._claim_idempotency_key(
    p_queue pgque.queue, p_part smallint, p_key text, p_id bigint, p_due timestamptz,
    p_now timestamptz, out event_id bigint, out due timestamptz, out duplicate boolean)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_claimed boolean;
begin
    for v_attempt in 1 .. 3 loop
        select k.ik_event, k.ik_due into event_id, due
          from pgque.idempotency_key k
         where k.ik_queue = p_queue.queue_id and k.ik_key = p_key
           and k.ik_time > p_now - p_queue.queue_idempotency_window
         order by k.ik_time desc
         limit 1;
        if found then
            duplicate := true;
            return;
        end if;
        -- Not recorded (or expired): claim it. A sender of the key still in
        -- flight makes this wait; once it commits, the conflict says so.
        insert into pgque.idempotency_key as k (ik_queue, ik_key, ik_event, ik_time, ik_due,
                                                ik_part)
        values (p_queue.queue_id, p_key, p_id, p_now, p_due, p_part)
        on conflict (ik_queue, ik_key, ik_part) do update
           set ik_event = excluded.ik_event, ik_time = excluded.ik_time,
               ik_due = excluded.ik_due
         where k.ik_time <= p_now - p_queue.queue_idempotency_window
        returning true into v_claimed;
        if v_claimed then
            event_id := p_id;
            due := p_due;
            duplicate := false;
            return;
        end if;
        -- Lost to a sender that committed meanwhile: its record, next round.
    end loop;
    raise exception using errcode = '40001',
        message = format('idempotency key %L kept changing while it was sent',
                         pgque._name_for_message(p_key)),
        hint = 'Retry the transaction.';
end
$$;

-- pgque._claim_idempotency_keys(queue, keys, ids, dues, now): the keys of
-- events being sent at now, given as arrays (keys[i] null: event i has none),
-- each with the id and due time its event would have, claimed as
-- _claim_idempotency_key claims one; returns the arrays as they are to be
-- sent: the event of a key recorded in its window already, by an earlier send
-- or an earlier element of keys, takes the recorded id and due time and is a
-- duplicate. Set-based for the usual case (one lookup of all the keys, one
-- insert of the new ones, in key order, so two senders of the same keys
-- never wait for each other in a cycle); a key that insert could not claim
-- (a sender of it in flight, or its expired record in this partition) goes
-- through _claim_idempotency_key, still in key order.
create or replace function pgque._claim_idempotency_keys(
    p_queue pgque.queue, p_keys text[], p_ids bigint[], p_dues timestamptz[], p_now timestamptz,
    out ids bigint[], out duplicates boolean[], out dues timestamptz[])
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_part smallint := pgque._idempotency_part();
    v_keys text[];         -- the distinct keys, in key order ...
    v_firsts integer[];    -- ... and the position of each one's first event
    -- What each key resolved to (in no order): its event id, due time, and
    -- whether that is an earlier send's.
    v_done text[];
    v_events bigint[];
    v_due timestamptz[];
    v_duplicate boolean[];
    v_left record;
    v_claim record;
begin
    select array_agg(x.key order by x.key collate "C"), array_agg(x.first order by x.key collate "C")
      into v_keys, v_firsts
      from (select k.key, min(k.i)::integer as first
              from unnest(p_keys) with ordinality as k(key, i)
             where k.key is not null
             group by k.key) x;
    -- Recorded already, within the window.
    select coalesce(array_agg(r.ik_key), '{}'), coalesce(array_agg(r.ik_event), '{}'),
           coalesce(array_agg(r.ik_due), '{}'), coalesce(array_agg(true), '{}')
      into v_done, v_events, v_due, v_duplicate
      from (select distinct on (k.ik_key) k.ik_key, k.ik_event, k.ik_due
              from pgque.idempotency_key k
             where k.ik_queue = p_queue.queue_id and k.ik_key = any(v_keys)
               and k.ik_time > p_now - p_queue.queue_idempotency_window
             order by k.ik_key, k.ik_time desc) r;
    -- New: claimed in one insert, in key order; a conflict (a sender of the
    -- key in flight, or its expired record here) leaves the key to the loop.
    with claimed as (
        insert into pgque.idempotency_key (ik_queue, ik_key, ik_event, ik_time, ik_due, ik_part)
        select p_queue.queue_id, k.key, p_ids[k.first], p_now, p_dues[k.first], v_part
          from unnest(v_keys, v_firsts) as k(key, first)
         where not exists (select from unnest(v_done) d(key) where d.key = k.key)
         order by k.key collate "C"
        on conflict (ik_queue, ik_key, ik_part) do nothing
        returning ik_key, ik_event, ik_due)
    select v_done || coalesce(array_agg(c.ik_key), '{}'),
           v_events || coalesce(array_agg(c.ik_event), '{}'),
           v_due || coalesce(array_agg(c.ik_due), '{}'),
           v_duplicate || coalesce(array_agg(false), '{}')
      into v_done, v_events, v_due, v_duplicate
      from claimed c;
    for v_left in select k.key, k.first from unnest(v_keys, v_firsts) as k(key, first)
                   where not exists (select from unnest(v_done) d(key) where d.key = k.key)
                   order by k.key collate "C" loop
        v_claim := pgque._claim_idempotency_key(p_queue, v_part, v_left.key,
                                                p_ids[v_left.first], p_dues[v_left.first], p_now);
        v_done := v_done || v_left.key;
        v_events := v_events || v_claim.event_id;
        v_due := v_due || v_claim.due;
        v_duplicate := v_duplicate || v_claim.duplicate;
    end loop;
    -- Each event: its key's resolution; duplicate unless it is the first of a
    -- key that this send recorded.
    select array_agg(coalesce(r.event_id, p_ids[e.i]) order by e.i),
           array_agg(coalesce(r.duplicate or e.i <> f.first, false) order by e.i),
           array_agg(case when r.key is null then p_dues[e.i] else r.due end order by e.i)
      into ids, duplicates, dues
      from unnest(p_keys) with ordinality as e(key, i)
      left join unnest(v_keys, v_firsts) as f(key, first) on f.key = e.key
      left join unnest(v_done, v_events, v_due, v_duplicate) as r(key, event_id, due, duplicate)
        on r.key = e.key;
end
$$;

-- pgque._idempotency_keys(queue_id): how many keys the queue remembers now
-- (within its window). Reads every such row: for status, not a hot path.
create or replace function pgque._idempotency_keys(p_queue pgque.queue)
returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select count(distinct k.ik_key)
      from pgque.idempotency_key k
     where k.ik_queue = p_queue.queue_id
       and k.ik_time > clock_timestamp() - p_queue.queue_idempotency_window
$$;
