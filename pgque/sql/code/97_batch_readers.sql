-- pgque: every queue's batch reader, written again from the current template.
--
-- The install dropped them with the rest of the code (05_drop_code.sql);
-- see 64_batch_reader.sql for what they are. Each queue's maintenance lock
-- keeps a concurrent maintenance pass from writing the same reader.

do $readers$
declare
    v_queue_id integer;
begin
    for v_queue_id in select q.queue_id from pgque.queue q order by q.queue_id loop
        perform pgque._lock_queue(v_queue_id, 'maint', true);
        perform pgque._sync_batch_reader(v_queue_id);
    end loop;
end
$readers$;
