-- pgque: receiving and acking several slots of a group in one call.
--
-- A session that owns many slots (a worker with few lanes, a consumer that
-- drains a whole group) would otherwise make a receive and an ack per slot:
-- two round trips, two commits and the queue and group lookups, times the
-- slots. These do the same per slot, with the same checks, in one statement
-- each, as Kafka's poll returns the records of every assigned partition.
-- Each slot's piece is the one receive_partitioned would return; nothing
-- about order or ownership changes.


-- pgque.receive_slots(queue, consumer, slots, slot_list, max_events): for each
-- slot of slot_list (slots of a group of slots), what receive_partitioned
-- would return, as rows led by the slot, ascending by slot; slots with
-- nothing to receive return no row. One transaction: a failure (PQ024 for a
-- slot this session does not own) receives nothing. max_events bounds each
-- slot's piece.
create or replace function pgque.receive_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_max_events integer default null)
returns table (slot integer, batch_id bigint, ev_id bigint, ev_time timestamptz,
               ev_retry integer, ev_type text, ev_data text, ev_extra1 text, epoch bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v record;
begin
    perform pgque._check_max_events(p_max_events);
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    for v in select * from pgque._slot_subs(v_queue, v_group, p_slot_list) loop
        return query select v.slot, r.batch_id, r.ev_id, r.ev_time, r.ev_retry, r.ev_type,
                            r.ev_data, r.ev_extra1, r.epoch
                       from pgque._receive_slot(v_queue, v_group, v.slot, v.sub, v.cur,
                                                p_max_events) r;
    end loop;
end
$$;

-- pgque.ack_slots(queue, consumer, slots, slot_list, batch_ids): acks, for each
-- slot of slot_list, the batch piece batch_ids names at the same position
-- (what ack_partitioned does for one), in one transaction, slots locked in
-- ascending order; returns, in the order given, whether each ack finished
-- its batch. Raises 22023 for a null list, a slot named twice or lists of
-- different lengths, PQ023 for a slot out of range, PQ024 for a slot this
-- session does not own, PQ003 for a batch that is not the slot's open one:
-- then nothing is acked.
create or replace function pgque.ack_slots(
    p_queue text, p_consumer text, p_slots integer, p_slot_list integer[],
    p_batch_ids bigint[])
returns boolean[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_group pgque.consumer_group;
    v record;
    v_locked record;
    v_done boolean[] := '{}';
begin
    perform pgque._check_slot(0, p_slots);
    v_group := pgque._group(v_queue, p_consumer, p_slots);
    perform pgque._check_slot_list(v_group, p_slot_list);
    if p_batch_ids is null or cardinality(p_slot_list) <> cardinality(p_batch_ids) then
        raise exception using errcode = '22023',
            message = 'ack_slots: the batch ids must be as many as the slots';
    end if;
    -- As ack_partitioned for each, slot after slot in ascending order; the
    -- result goes where the slot was given.
    for v in select b.slot, b.batch_id, b.pos
               from unnest(p_slot_list, p_batch_ids) with ordinality as b(slot, batch_id, pos)
              order by b.slot loop
        select f.sub, f.cur into v_locked
          from pgque._find_subscription(
                   v_queue, pgque._slot_name(p_consumer, v.slot, v_group.cg_slots), true) f;
        perform pgque._require_owner(v_locked.sub);
        v_done[v.pos] := pgque._ack(v_locked.sub, v_locked.cur, v.batch_id);
    end loop;
    return v_done;
end
$$;
