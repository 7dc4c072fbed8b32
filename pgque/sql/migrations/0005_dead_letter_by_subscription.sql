-- Migration 5 (pgque 0.2.0): dead letters are counted per subscription
-- (dl_sub, see 0002) by the info views: an index to count them by.
create index if not exists dead_letter_sub_idx on pgque.dead_letter (dl_sub);
