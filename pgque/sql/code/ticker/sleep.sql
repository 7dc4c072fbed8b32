-- pgque: the sleeping ticker.
--
-- A ticker that polls every few milliseconds delivers the first event after
-- a quiet spell quickly, and costs a core a few percent for it all day. So
-- the active Ticker, once nothing has been ticked for a while, falls asleep:
-- it LISTENs on the ticker channel, sets every queue's queue_ticker_asleep
-- (ticker_sleep), and polls only now and then. A send into a queue whose flag
-- is set notifies the channel at its commit (the notification carries
-- nothing); the ticker looks at once, and when that look ticks something it
-- clears the flags (ticker_wake) and stays awake. The flags are written when
-- the ticker falls asleep and when it wakes, never per send (a poll while
-- asleep marks only queues made or skipped since): an idle queue writes no
-- more WAL than before, and a busy one never notifies.
--
-- A send whose statement read the flag before the ticker set it, and which
-- commits after the ticker's look that follows, sends no notification: its
-- events wait for the next poll. So does whatever becomes due without a send:
-- retries, delayed events, the idle period's ticks.
--
-- Only the session that holds the ticker election sets or clears the flags,
-- and a newly elected ticker (a Python Ticker, pg_cron's ticker_loop) clears
-- them first; a Ticker that stops clears them too. One that went away asleep
-- leaves its queues notifying nobody (cheap) until the next one is elected.
--
-- The flags are written without waiting: a queue row another transaction
-- holds (maintenance rotating it, alter_queue) is skipped and marked at the
-- sleeping ticker's next poll, which also marks queues created meanwhile.
-- The row lock is FOR NO KEY UPDATE, which the foreign-key checks' FOR KEY
-- SHARE (a subscribe in a transaction left open, say) does not block.
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
-- while the ticker sleeps (one notification per sending transaction, empty).
create or replace function pgque.ticker_channel()
returns text
language sql immutable
security definer
set search_path = pg_catalog, pg_temp
as $$ select pgque._ticker_channel() $$;

-- pgque._wake_ticker(): notifies the ticker channel at the caller's commit,
-- unless the server allows prepared transactions (see the top). The senders
-- call it when the queue row they read says the ticker sleeps.
create or replace function pgque._wake_ticker()
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if not pgque._ticker_may_sleep() then
        return;
    end if;
    perform pg_notify(pgque._ticker_channel(), '');
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

-- pgque.ticker_sleep(): marks every queue's ticker as asleep, so that sends
-- into it notify the ticker channel; returns how many queues it marked (none
-- when they all were, or when a queue row was busy: it is skipped, see the
-- top), or null where the ticker must not sleep (prepared transactions
-- allowed; nothing marked). For the active ticker only (55000 otherwise),
-- which must LISTEN on ticker_channel() before, and look for due ticks once
-- more after, its commit (a send may have read the flags before it); while
-- asleep it calls this again at each poll, for the queues skipped or created.
create or replace function pgque.ticker_sleep()
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_count integer;
begin
    perform pgque._require_elected('sleep');
    if not pgque._ticker_may_sleep() then
        return null;
    end if;
    update pgque.queue q set queue_ticker_asleep = true
     where q.queue_id in (select l.queue_id from pgque.queue l where not l.queue_ticker_asleep
                           for no key update skip locked);
    get diagnostics v_count = row_count;
    return v_count;
end
$$;

-- pgque.ticker_wake(): marks every queue's ticker as awake again, so that
-- sends stop notifying; returns how many queues it marked. For the active
-- ticker only (55000 otherwise): when it wakes, and when it is elected (its
-- predecessor may have gone away asleep).
create or replace function pgque.ticker_wake()
returns integer
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
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
     where q.queue_id in (select l.queue_id from pgque.queue l where l.queue_ticker_asleep
                           order by l.queue_id for no key update);
    get diagnostics v_count = row_count;
    return v_count;
end
$$;
