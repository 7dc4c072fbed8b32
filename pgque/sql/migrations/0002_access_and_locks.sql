-- Migration 2 (pgque 0.2.0): access between teams, and locks no role outside
-- pgque can take.
--
-- Random lock keys are drawn here with the expression of pgque._random_key(),
-- written out: migrations run before the code is created.

-- The per-queue locks, one row per queue and purpose, taken FOR UPDATE:
--   tick   serializes the ticks of a queue (pgque._make_tick); the ticker
--          takes it SKIP LOCKED and passes over a queue being ticked or
--          dropped elsewhere;
--   maint  serializes the maintenance of a queue; a second maint() caller
--          takes it SKIP LOCKED and skips the queue.
-- drop_queue takes both, tick first, then the queue row: the order everyone
-- follows. Rows, not advisory locks: an advisory key is a constant any role
-- that can connect may hold forever, while these rows are reachable only
-- through pgque's SECURITY DEFINER functions. create_queue inserts them; the
-- insert below gives them to the queues that exist. Taking one assigns a
-- transaction id and writes WAL, so the ticker and maintenance first look,
-- without any lock, whether there is anything to do.
create table if not exists pgque.queue_lock (
    ql_queue   integer not null references pgque.queue on delete cascade,
    ql_purpose text not null check (ql_purpose in ('tick', 'maint')),
    primary key (ql_queue, ql_purpose)
);
insert into pgque.queue_lock (ql_queue, ql_purpose)
select q.queue_id, p.purpose
  from pgque.queue q cross join (values ('tick'), ('maint')) p (purpose)
on conflict do nothing;

-- Queue grants (see code/base/access.sql): the roles granted 'send' and
-- 'consume'; null, as for every queue here, means no restriction.
alter table pgque.queue add column if not exists queue_senders oid[];
alter table pgque.queue add column if not exists queue_consumers oid[];

-- A plain consumer belongs to the role that subscribed it (sub_owner; null for
-- the subscriptions made before, which every reader may use, as then), with the
-- roles granted access to it. A slot subscription belongs to its consumer group
-- and carries the random key of the session advisory lock that owns the slot
-- (see code/slots/groups.sql); the subscription row changes only when access
-- is granted or that key is renewed, both rare.
alter table pgque.subscription add column if not exists sub_owner oid;
alter table pgque.subscription add column if not exists sub_grantees oid[];
alter table pgque.subscription add column if not exists sub_lock_key bigint;
update pgque.subscription
   set sub_lock_key = ('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8),
                                     'hex'))::bit(64)::bigint
 where sub_lock_key is null and position('#' in sub_consumer) > 0;

-- The same for consumer groups, whose membership lock has a random key too.
alter table pgque.consumer_group add column if not exists cg_owner oid;
alter table pgque.consumer_group add column if not exists cg_grantees oid[];
alter table pgque.consumer_group add column if not exists cg_lock_key bigint;
update pgque.consumer_group
   set cg_lock_key = ('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8),
                                    'hex'))::bit(64)::bigint
 where cg_lock_key is null;

-- The subscription a dead letter came from (no foreign key: dead letters
-- outlive it). Who may read a dead letter follows that subscription, not its
-- name, which another role may subscribe once the consumer is gone. Filled
-- from the names of the subscriptions that exist now; the dead letters of
-- consumers gone before stay null: admins only.
alter table pgque.dead_letter add column if not exists dl_sub integer;
update pgque.dead_letter d set dl_sub = s.sub_id
  from pgque.subscription s
 where d.dl_sub is null and s.sub_queue = d.dl_queue and s.sub_consumer = d.dl_consumer;

-- The key of the session advisory lock that elects the active ticker: random
-- per install (and renewed when a role outside pgque sits on it), so a role
-- without pgque rights cannot know it in advance. One row.
create table if not exists pgque.ticker_election (
    te_single boolean primary key default true check (te_single),
    te_key    bigint not null
);
insert into pgque.ticker_election (te_key)
values (('x' || encode(substr(sha256(uuid_send(gen_random_uuid())), 1, 8), 'hex'))::bit(64)::bigint)
on conflict do nothing;
