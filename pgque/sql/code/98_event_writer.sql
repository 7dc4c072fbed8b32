-- pgque: the event writer, written again from the current template.
--
-- See 31_event_writer.sql for what it is. Dropped with the rest of the code
-- (05_drop_code.sql), so written here for the queues there are; the install
-- holds pgque.install_lock FOR UPDATE, which keeps create_queue and
-- drop_queue, its other writers, out until it commits.

do $writer$
begin
    perform pgque._sync_event_writer();
end
$writer$;
