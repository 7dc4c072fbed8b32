-- pgque: routines of earlier versions that this one no longer has.
--
-- Dropped so that an upgraded install is the same as a fresh one (the
-- internal ones were never granted to anybody). Quietly: on a fresh install,
-- and on every run after the first, there is nothing to drop.

set local client_min_messages = warning;
drop function if exists pgque._group_lock_class();
drop function if exists pgque._holds_lock(bigint, integer, text);
drop function if exists pgque._holds_slot(integer);
drop function if exists pgque._refuse_slot(pgque.subscription);
drop function if exists pgque._slot_lock_class();
drop function if exists pgque._ticker_lock_key();
set local client_min_messages = notice;
