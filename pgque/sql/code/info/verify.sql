-- pgque: checking a group's record of handler calls (slots/handling.sql)
-- against what pgque promises: `pgque verify`.
--
-- What is checked, for the calls that started since the group's recording
-- began (or since a time the caller gives):
--
-- * routing (G1): every call of a key ran in the slot the key routes to;
-- * per-key order: the first calls of a key's events (retry count 0) came in
--   delivery order (docs/guarantees.md, per-key order): no event first handled
--   after an event of its key with a larger id from the same batch or a later
--   one. (An event of a later batch with a smaller id may come after:
--   its transaction committed later, or it was held under the pause policy,
--   whose pieces take a batch id when first handed out and keep it when
--   handed out again.) Calls less than clock_skew apart are not judged.
--   Under the pause policy, the events of a key delivered after one that
--   failed (by batch, then id) that started after the failure and before the
--   failed event's next call or its dead letter are reported, not as
--   violations: an operator's resume_key, skip_head, or a dead letter
--   replayed or purged releases the key, and the record does not hold those;
-- * one handler per key at a time: no two calls of a key overlap in time. An
--   overlap where the earlier call ran under an older epoch than the later
--   (the previous owner's call in flight when its slot moved, docs/guarantees.md
--   "What is not guaranteed") is reported as a zombie window, not a violation;
--   calls more than clock_skew apart only count, for workers whose clocks differ;
-- * nothing lost: every event sent since then (as far as the event tables
--   still hold it) that a slot's cursor has passed has a call that returned,
--   a call that dead-lettered it, a dead letter, or a retry or held copy still
--   to come.
--
-- The cost is a read of the calls and of the event tables since the start;
-- a validation tool, not a hot path.

-- pgque._recorded_group(queue, consumer, since): the group (checked as a
-- receive checks it, without a slot count) and the start of the window: the
-- group's recording start, or since when that is later; PQ033 for a group
-- that has no recording start (none of its workers recorded since its record
-- was last forgotten), whatever since.
create or replace function pgque._recorded_group(
    p_queue pgque.queue, p_consumer text, p_since timestamptz,
    out grp pgque.consumer_group, out since timestamptz)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    grp := pgque._group(p_queue, p_consumer, null);
    since := greatest(p_since, grp.cg_recorded_since);  -- (greatest ignores a null)
    if grp.cg_recorded_since is null then
        raise exception using errcode = 'PQ033',
            message = format('consumer group %L of queue %L has no record of handler calls',
                             pgque._name_for_message(p_consumer), p_queue.queue_name),
            hint = 'Run its workers with record=True (pgque worker --record), then verify.';
    end if;
end
$$;

-- pgque.handling_summary(queue, consumer, since): what the group's record
-- holds since since (default: its recording start): the start used, how many
-- calls, of how many events and keys, by how many workers, the first call's
-- start and the last call's end. PQ033 as for verify_handling.
create or replace function pgque.handling_summary(
    p_queue text, p_consumer text, p_since timestamptz default null,
    out since timestamptz, out calls bigint, out events bigint, out keys bigint,
    out workers bigint, out first_call timestamptz, out last_call timestamptz)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_group record := pgque._recorded_group(pgque._queue_row(p_queue), p_consumer, p_since);
begin
    since := v_group.since;
    select count(*), count(distinct (h.hd_sub, h.hd_ev_id)), count(distinct h.hd_key),
           count(distinct h.hd_worker), min(h.hd_started), max(h.hd_ended)
      into calls, events, keys, workers, first_call, last_call
      from pgque._group_subs(v_group.grp) g
      join pgque.handling h on h.hd_sub = g.sub_id
     where h.hd_started >= since;
end
$$;

-- pgque.verify_handling(queue, consumer, since, clock_skew): the findings of
-- the checks above on the group's record since since (default: its recording
-- start, or since when that is later), ordered by time. kind is 'misrouted',
-- 'reorder', 'paused', 'overlap', 'zombie_window' or 'lost'; violation is
-- false for a zombie window, a call while its key was paused, and under the
-- pause policy for a reorder. slot, partition_key and ev_id name the call or event found, other_ev_id
-- the other event involved (the one it came after, overlapped or was held
-- behind), at the time of the finding, detail says it in words. No row: the
-- record shows nothing wrong. PQ033 for a group without a record; PQ001,
-- PQ002, PQ014, PQ015 as for a receive; 22023 for a negative clock_skew.
create or replace function pgque.verify_handling(
    p_queue text, p_consumer text, p_since timestamptz default null,
    p_clock_skew interval default interval '0')
returns table (kind text, violation boolean, slot integer, partition_key text, ev_id bigint,
               other_ev_id bigint, at timestamptz, detail text)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
#variable_conflict use_column
declare
    v_queue pgque.queue := pgque._queue_row(p_queue);
    v_recorded record;
    v_group pgque.consumer_group;
    v_since timestamptz;
    v_at record;
begin
    if p_clock_skew is null or p_clock_skew < interval '0' then
        raise exception using errcode = '22023',
            message = 'verify_handling: clock_skew must not be negative';
    end if;
    v_recorded := pgque._recorded_group(v_queue, p_consumer, p_since);
    v_group := v_recorded.grp;
    v_since := v_recorded.since;

    return query
    with calls as materialized (
        select g.slot, h.*,
               row_number() over (order by h.hd_started, h.hd_sub, h.hd_ev_id) as n,
               -- the next call of the same event, if any
               lead(h.hd_started) over (partition by h.hd_sub, h.hd_ev_id
                                        order by h.hd_started) as next_call
          from pgque._group_subs(v_group) g
          join pgque.handling h on h.hd_sub = g.sub_id
         where h.hd_started >= v_since
    ),
    -- G1: the key's slot.
    misrouted as (
        select 'misrouted'::text as kind, true as violation, c.slot, c.hd_key, c.hd_ev_id,
               null::bigint as other, c.hd_started as at,
               format('handled in slot %s; its key routes to slot %s of %s', c.slot,
                      pgque.slot_of(c.hd_key, v_group.cg_slots), v_group.cg_slots) as detail
          from calls c
         where pgque.slot_of(c.hd_key, v_group.cg_slots) <> c.slot
    ),
    -- Order: each event's first call (not a retry), in delivery order per key.
    firsts as (
        select distinct on (c.hd_sub, c.hd_ev_id) c.*
          from calls c
         where c.hd_retry = 0 and c.hd_key is not null
         order by c.hd_sub, c.hd_ev_id, c.hd_started, c.n
    ),
    firsts_in_turn as (
        select f.*, lag(f.hd_batch) over w as prev_batch, lag(f.hd_ev_id) over w as prev_ev,
               lag(f.hd_started) over w as prev_started
          from firsts f
        window w as (partition by f.hd_key order by f.hd_started, f.n)
    ),
    reorder as (
        -- (Under pause, not judged: held pieces take their batch ids when handed
        -- out, so a piece handed out again after a lost session, or the next
        -- held piece, can carry ids that do not follow delivery; seen in the
        -- demo's pause run with a session cut, whose own order check held.)
        select 'reorder'::text, v_group.cg_policy <> 'pause', f.slot, f.hd_key, f.hd_ev_id,
               f.prev_ev, f.hd_started,
               format('first handled after event %s of its key (batch %s), which comes '
                      'after it (this one is of batch %s)', f.prev_ev, f.prev_batch, f.hd_batch)
          from firsts_in_turn f
         where f.hd_ev_id < f.prev_ev and f.hd_batch <= f.prev_batch
           and f.hd_started > f.prev_started + p_clock_skew  -- (else the clocks may tell)
    ),
    -- One at a time: each call against the latest end of the key's calls that
    -- started before it.
    ends as (
        select c.*, max(c.hd_ended) over (partition by c.hd_key order by c.hd_started, c.n
                                          rows between unbounded preceding and 1 preceding)
                        as busy_until
          from calls c
         where c.hd_key is not null
    ),
    overlap as (
        select case when p.hd_epoch < e.hd_epoch then 'zombie_window' else 'overlap' end,
               not coalesce(p.hd_epoch < e.hd_epoch, false), e.slot, e.hd_key, e.hd_ev_id,
               p.hd_ev_id, e.hd_started,
               format('started by %s (epoch %s) while event %s of its key ran in %s (epoch %s) '
                      'for %s more', e.hd_worker, e.hd_epoch, p.hd_ev_id, p.hd_worker,
                      p.hd_epoch, e.busy_until - e.hd_started)
          from ends e
          cross join lateral (select p.* from calls p
                               where p.hd_key = e.hd_key and p.hd_ended = e.busy_until
                                 and p.n < e.n
                               order by p.n limit 1) p
         where e.busy_until - p_clock_skew > e.hd_started
    ),
    -- Pause: after a failure of an event, nothing delivered after it of its
    -- key until that event is called again or dead-lettered. (An event
    -- delivered before it may come again after it: a piece handed out again
    -- after its worker died.) Not a violation by itself: an operator's
    -- resume_key, skip_head, or a dead letter replayed or purged, releases
    -- the hold, and the record does not hold those.
    holds as (
        select f.*, least(f.next_call, d.dl_time) as until
          from calls f
          left join (select dl.dl_sub, dl.ev_id, min(dl.dl_time) as dl_time
                       from pgque.dead_letter dl
                      where dl.dl_sub = any(array(select g.sub_id
                                                    from pgque._group_subs(v_group) g))
                      group by dl.dl_sub, dl.ev_id) d
            on d.dl_sub = f.hd_sub and d.ev_id = f.hd_ev_id
         where v_group.cg_policy = 'pause' and f.hd_outcome = 'f' and f.hd_key is not null
    ),
    paused as (
        -- (Each call once, with the first hold it broke.)
        select distinct on (x.n)
               'paused'::text, false, x.slot, x.hd_key, x.hd_ev_id, f.hd_ev_id, x.hd_started,
               format('started while its key was paused behind event %s, which failed at %s '
                      '(a violation unless an operator released the key)',
                      f.hd_ev_id, f.hd_ended)
          from holds f
          join calls x
            on x.hd_key = f.hd_key and (x.hd_batch, x.hd_ev_id) > (f.hd_batch, f.hd_ev_id)
           and x.hd_started > f.hd_ended + p_clock_skew
           and (f.until is null or x.hd_started < f.until)
         order by x.n, f.hd_ended
    )
    select * from misrouted
    union all select * from reorder
    union all select * from overlap
    union all select * from paused
    order by 7, 5;

    -- Nothing lost: each slot's events that its cursor passed (visible in the
    -- snapshot of its last finished batch's tick), sent since the start.
    v_at := pgque._group_positions(v_queue, v_group);
    if v_at.slots is null then
        return;
    end if;
    return query execute format(
        'select ''lost''::text, true, o.k, e.ev_extra1, e.ev_id, null::bigint, e.ev_time,'
        '       ''its slot passed it, but no call returned, no dead letter or retry holds it'''
        '  from pgque.%1$I e'
        '  join unnest($2, $3, $4) as o(k, sub, snap)'
        '    on o.k = %2$s'
        ' where e.ev_owner is null and e.ev_time >= $1'
        '   and pg_visible_in_snapshot(e.ev_txid, o.snap)'
        '   and not exists (select from pgque.handling h'
        '                    where h.hd_sub = o.sub and h.hd_ev_id = e.ev_id'
        '                      and h.hd_outcome in (''o'', ''d''))'
        '   and not exists (select from pgque.dead_letter d'
        '                    where d.dl_sub = o.sub and d.ev_id = e.ev_id)'
        '   and not exists (select from pgque._retry_waiting r'
        '                    where r.ev_owner = o.sub and r.ev_id = e.ev_id)'
        '   and not exists (select from pgque.held_event x'
        '                     join pgque.blocked_key b'
        '                       on b.bk_sub = x.he_sub and b.bk_key = x.he_key'
        '                    where x.he_sub = o.sub and x.ev_id = e.ev_id'
        '                      and x.he_seq > b.bk_done_seq)'
        '   and not exists (select from pgque.%1$I x'
        '                    where x.ev_owner = o.sub and x.ev_id = e.ev_id'
        '                      and not pg_visible_in_snapshot(x.ev_txid, o.snap))'
        ' order by e.ev_time, e.ev_id',
        pgque._event_table(v_queue.queue_id), pgque._slot_expr(v_group.cg_slots))
    using v_since, v_at.slots, v_at.subs, v_at.snaps;
end
$$;
