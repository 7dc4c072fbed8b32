-- pgque: the sleeping ticker.
--
-- A ticker that polls every few milliseconds delivers the first event after
-- a quiet spell quickly, and costs a core a few percent for it all day; and
-- one that polls every queue every few milliseconds costs, in a database of
-- thousands of queues, a core for the few that are busy. So the active Ticker
-- polls often only the queues that were busy lately (its hot queues), and lets
-- the others sleep: it sets their queue_ticker_asleep (ticker_sleep, every
-- queue but the hot ones), LISTENs on the ticker channel, and looks at every
-- queue only now and then. A send into a queue whose flag is set notifies the
-- channel at its commit, the queue's id as the payload; the ticker looks at
-- that queue at once, and when the look ticks something it clears its flag
-- (ticker_wake) and polls it often until it is quiet again. With no hot queue
-- the whole ticker sleeps. The flags are written when a queue falls asleep and
-- when it wakes, never per send (a look at every queue marks only queues made
-- or skipped since): an idle queue writes no more WAL than before, and a busy
-- one never notifies.
--
-- A send whose statement read the flag before the ticker set it, and which
-- commits after the ticker's look that follows, sends no notification: its
-- events wait for the next look at every queue. So does whatever becomes due
-- without a send: retries, delayed events, the idle period's ticks.
--
-- Only the session that holds the ticker election sets or clears the flags,
-- and a newly elected ticker (a Python Ticker, pg_cron's ticker_loop) clears
-- them first; a Ticker that stops clears them too. One that went away asleep
-- leaves its queues notifying nobody (cheap) until the next one is elected.
--
-- The flags are written without waiting: a queue row another transaction
-- holds (maintenance rotating it, alter_queue) is skipped and marked at the
-- ticker's next look at every queue, which also marks queues created
-- meanwhile. The row lock is FOR NO KEY UPDATE, which the foreign-key checks'
-- FOR KEY SHARE (a subscribe in a transaction left open, say) does not block.
--
-- PREPARE TRANSACTION refuses a transaction that ran NOTIFY, so where the
-- server allows prepared transactions (max_prepared_transactions > 0) sends
-- never notify, and the ticker does not sleep.

-- pgque._ticker_channel(): the channel a sleeping ticker listens on.
create or replace function pgque._ticker_channel()
returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$ select 'pgque_ticker' $$;

-- pgque.ticker_channel(): the channel to LISTEN on to hear of sends into queues
-- whose ticker sleeps (one notification per sending transaction and queue,
-- the queue's id as its payload).
create or replace function pgque.ticker_channel()
returns text
language sql immutable
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$ select pgque._ticker_channel() $$;

-- pgque._wake_ticker(queue_id): notifies the ticker channel at the caller's
-- commit that the queue has something new, unless the server allows prepared
-- transactions (see the top). The senders call it when the queue row they
-- read says the queue sleeps. The payload only says where to look at once:
-- the ticker's look at every queue, once a second, covers a notification
-- lost or unread.
create or replace function pgque._wake_ticker(p_queue_id integer)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._ticker_may_sleep() then
        return;
    end if;
    perform pg_notify(pgque._ticker_channel(), p_queue_id::text);
end
$$;

-- pgque._ticker_may_sleep(): whether sends may notify the ticker: not where a
-- sending transaction could be prepared (PREPARE refuses a NOTIFY).
create or replace function pgque._ticker_may_sleep()
returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return current_setting('max_prepared_transactions')::integer = 0;
end
$$;

-- pgque._require_elected(action): raises 55000 unless this session holds the
-- ticker election: only the active ticker listens, so only it may say that
-- it sleeps.
create or replace function pgque._require_elected(p_action text)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._holds_key(pgque._ticker_key()) then
        raise exception using errcode = '55000',
            message = format('only the active ticker may %s', p_action),
            hint = 'Call pgque.claim_ticker() on this session first.';
    end if;
end
$$;

-- pgque.ticker_sleep(except): marks every queue's ticker as asleep but those
-- whose ids are in except (null: every queue), so that sends into them notify
-- the ticker channel; returns how many queues it marked (none when they all
-- were, or when a queue row was busy: it is skipped, see the top), or null
-- where the ticker must not sleep (prepared transactions allowed; nothing
-- marked). For the active ticker only (55000 otherwise), which must LISTEN on
-- ticker_channel() before, and look for due ticks in the queues it marked
-- once more after, its commit (a send may have read the flags before it);
-- it calls this again at each look at every queue, for the queues skipped or
-- created.
create or replace function pgque.ticker_sleep(p_except integer[] default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_count integer;
begin
    perform pgque._require_elected('sleep');
    if not pgque._ticker_may_sleep() then
        return null;
    end if;
    update pgque.queue q set queue_ticker_asleep = true
     where q.queue_id in (select l.queue_id from pgque.queue l
                           where not l.queue_ticker_asleep
                             and (p_except is null or l.queue_id <> all(p_except))
                           for no key update skip locked);
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque.ticker_wake(queues): marks the ticker of the queues whose ids are in
-- queues (null: every queue) as awake again, so that sends into them stop
-- notifying; returns how many queues it marked. For the active ticker only
-- (55000 otherwise): when a queue wakes, and for every queue when it is
-- elected (its predecessor may have gone away asleep) and when it stops.
create or replace function pgque.ticker_wake(p_queues integer[] default null)
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_count integer;
begin
    perform pgque._require_elected('wake');
    -- Waits for a busy row (briefly: the writers of queue rows are short), as
    -- a queue left marked would notify for nothing. FOR NO KEY UPDATE, which
    -- foreign-key checks never block, in queue_id order, as maintenance takes
    -- the rows: no deadlock with it.
    update pgque.queue q set queue_ticker_asleep = false
     where q.queue_id in (select l.queue_id from pgque.queue l
                           where l.queue_ticker_asleep
                             and (p_queues is null or l.queue_id = any(p_queues))
                           order by l.queue_id for no key update);
    get diagnostics v_count = row_count;
    return v_count;
end
$$;
