-- pgque: every piece of generated code written again from the current
-- templates, for the queues there are (see code/generated/generator.sql):
-- install/drop_code.sql dropped it with the rest of the code, under the
-- generators' lock, which this transaction still holds.

do $generated$
declare
    v_queue_id integer;
begin
    perform pgque._sync_event_writer(true);
    for v_queue_id in select q.queue_id from pgque.queue q order by q.queue_id loop
        perform pgque._sync_batch_reader(v_queue_id, true);
    end loop;
end
$generated$;
