-- Migration 6 (after pgque 0.2.0): a slot's epoch names the session that took it by
-- pid and session key (see code/66_fence.sql), not by the backend's start
-- time, which pg_stat_activity hides from an installer without
-- pg_read_all_stats. The epochs in place stay; their sessions are unknown, so
-- they fence nothing in (check_fence refuses them) and every slot's next
-- receive takes a new one.
alter table pgque.slot_claim add column if not exists sc_session bigint;
alter table pgque.slot_claim drop column if exists sc_backend_start;
