-- pgque: retries: nacked events moved back into the log when due.

-- pgque._insert_events_sql(queue): the statement that moves rows of a CTE
-- named "src" into the queue's current event table, keeping ev_id, ev_time,
-- ev_retry, ev_type, ev_data and ev_extra1 (the partition key), with a new ev_txid (the moving
-- transaction's) and src.ev_owner as the only subscription that sees them.
create or replace function pgque._insert_events_sql(p_queue pgque.queue)
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select format(
        'insert into pgque.%I (ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1)'
        ' select ev_id, ev_time, ev_owner, ev_retry, ev_type, ev_data, ev_extra1'
        '   from src order by ev_id',
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
