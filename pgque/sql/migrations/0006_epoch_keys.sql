-- Migration 6 (pgque 0.3.0): a slot's epoch names the session that took it by
-- pid and an advisory lock that session holds, the epoch's key (see
-- code/slots/fence.sql), no longer by the backend's start time, which
-- pg_stat_activity hides from an installer without pg_read_all_stats. The
-- epochs in place stay; nobody holds their keys, so they fence nothing in
-- (check_fence refuses them) and every slot's next receive takes a new one.
alter table pgque.slot_claim drop column if exists sc_backend_start;
