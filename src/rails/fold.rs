//! The rails' bookkeeping, apart from any engine: which rails still owe a
//! report of each request's part, and the one report of the whole once
//! none does. Sans-IO (fed the rails' reports, hands back whole reports),
//! so that every order of reports can be tried on it.

use std::collections::HashMap;

use crate::ledger::{BlockId, Incarnation, PeerId, Reason, RequestId};

/// A read in flight on the rails.
#[derive(Debug)]
pub(crate) struct Read {
    /// Rails with a part still unreported (bit per rail).
    pub outstanding: u32,
    /// The first failure of a part.
    pub failure: Option<Reason>,
    /// Local blocks failed parts named.
    pub invalid: Vec<BlockId>,
    /// Per rail, its part's handle `i` is the caller's handle `map[r][i]`.
    pub map: Vec<Vec<u8>>,
    /// Each lender (peer, lend) and the rails the read went through to it.
    pub lenders: Vec<(PeerId, Incarnation, u32)>,
    /// Submitting failed: the parts that went are aborted, and the read is
    /// not reported.
    pub withdrawn: bool,
}

impl Read {
    /// A read whose parts went to the rails in `outstanding`.
    pub fn new(
        outstanding: u32,
        map: Vec<Vec<u8>>,
        lenders: Vec<(PeerId, Incarnation, u32)>,
        withdrawn: bool,
    ) -> Self {
        Read {
            outstanding,
            failure: None,
            invalid: Vec::new(),
            map,
            lenders,
            withdrawn,
        }
    }
}

/// A lend on the rails.
#[derive(Debug)]
struct Lend {
    /// Its incarnation (a later lend of the same id has another).
    token: Incarnation,
    /// Rails whose lend is still unreported (bit per rail).
    outstanding: u32,
    /// A rail's lend finished: its readers all reported.
    finished: bool,
    /// A rail's lend failed, and why (the first).
    failed: Option<Reason>,
    /// Lending failed on a rail: the rails that took it are aborted, and
    /// the lend is not reported.
    withdrawn: bool,
}

/// How one rail's lend ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LendEnd {
    /// Its readers all reported.
    Finished,
    /// It failed.
    Failed(Reason),
    /// Its lease ended (or an abort, or shutdown).
    Expired,
}

/// The whole lend's report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LendReport {
    /// A rail's lend finished: every reader reported through it (or
    /// through it and the others).
    Finished,
    /// No rail's finished and one failed: the first failure.
    Failed(Reason),
    /// No rail's finished or failed.
    Expired,
}

/// What taking a rail's report of a read's part did.
#[derive(Debug)]
pub(crate) enum Took {
    /// Not a part in flight on that rail (a repeat, or not this façade's):
    /// nothing changed.
    Nothing,
    /// A part ended; others are still out.
    Part,
    /// The last part ended: the read, to report unless withdrawn.
    Read(Read),
}

/// Reads and lends in flight on the rails.
#[derive(Debug, Default)]
pub(crate) struct Fold {
    reads: HashMap<RequestId, Read>,
    lends: HashMap<RequestId, Lend>,
}

impl Fold {
    /// Whether `id` is in flight (as a read or a lend).
    pub fn busy(&self, id: RequestId) -> bool {
        self.reads.contains_key(&id) || self.lends.contains_key(&id)
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.reads.len() + self.lends.len()
    }

    /// The rails `id` still has a part or a lend on.
    pub fn outstanding(&self, id: RequestId) -> Option<u32> {
        self.reads
            .get(&id)
            .map(|r| r.outstanding)
            .or_else(|| self.lends.get(&id).map(|l| l.outstanding))
    }

    /// A read went out on the rails in `read.outstanding` (none: nothing to
    /// track).
    pub fn begin_read(&mut self, id: RequestId, read: Read) {
        if read.outstanding != 0 {
            self.reads.insert(id, read);
        }
    }

    /// A lend of incarnation `token` went out on the rails in
    /// `outstanding`.
    pub fn begin_lend(
        &mut self,
        id: RequestId,
        token: Incarnation,
        outstanding: u32,
        withdrawn: bool,
    ) {
        if outstanding != 0 {
            self.lends.insert(
                id,
                Lend {
                    token,
                    outstanding,
                    finished: false,
                    failed: None,
                    withdrawn,
                },
            );
        }
    }

    /// Lend `id`'s incarnation and the rails it is still out on, once a
    /// rail's lend of it finished (`None`: no such lend, or none of its
    /// rails' finished yet).
    pub fn finished_out(&self, id: RequestId) -> Option<(Incarnation, u32)> {
        let lend = self.lends.get(&id)?;
        lend.finished.then_some((lend.token, lend.outstanding))
    }

    /// The caller's handle that rail `r`'s part's handle `h` of read `id` is.
    pub fn handle(&self, r: usize, id: RequestId, h: u8) -> Option<u8> {
        self.reads
            .get(&id)?
            .map
            .get(r)?
            .get(usize::from(h))
            .copied()
    }

    /// The lenders of read `id` (peer, lend, rails used).
    pub fn lenders(&self, id: RequestId) -> &[(PeerId, Incarnation, u32)] {
        self.reads.get(&id).map_or(&[], |r| &r.lenders)
    }

    /// Rail `r` reported its part of read `id`: well (`failure` none) or
    /// failed, naming `blocks`.
    pub fn part_ended(
        &mut self,
        r: usize,
        id: RequestId,
        failure: Option<Reason>,
        blocks: &[BlockId],
    ) -> Took {
        let Some(read) = self.reads.get_mut(&id) else {
            return Took::Nothing;
        };
        if r >= 32 || read.outstanding & 1 << r == 0 {
            return Took::Nothing;
        }
        read.outstanding &= !(1 << r);
        if let Some(reason) = failure {
            read.failure.get_or_insert(reason);
            read.invalid.extend_from_slice(blocks);
        }
        if read.outstanding != 0 {
            return Took::Part;
        }
        match self.reads.remove(&id) {
            Some(mut read) => {
                read.invalid.sort_unstable();
                read.invalid.dedup();
                Took::Read(read)
            }
            None => Took::Nothing,
        }
    }

    /// Rail `r` reported its lend of `id`. The whole lend's report once no
    /// rail's is out (none if it was withdrawn).
    pub fn lend_ended(&mut self, r: usize, id: RequestId, end: LendEnd) -> Option<LendReport> {
        let lend = self.lends.get_mut(&id)?;
        if r >= 32 || lend.outstanding & 1 << r == 0 {
            return None;
        }
        lend.outstanding &= !(1 << r);
        match end {
            LendEnd::Finished => lend.finished = true,
            LendEnd::Failed(reason) => {
                lend.failed.get_or_insert(reason);
            }
            LendEnd::Expired => {}
        }
        if lend.outstanding != 0 {
            return None;
        }
        let lend = self.lends.remove(&id)?;
        if lend.withdrawn {
            return None;
        }
        Some(match (lend.finished, lend.failed) {
            (true, _) => LendReport::Finished,
            (false, Some(reason)) => LendReport::Failed(reason),
            (false, None) => LendReport::Expired,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Cause;
    use proptest::prelude::*;

    /// A rail's report: which rail, which request, how it ended.
    #[derive(Debug, Clone)]
    struct Report {
        rail: usize,
        id: u64,
        failed: bool,
    }

    #[derive(Debug, Clone)]
    struct Case {
        /// Per request: is a read, its rails, withdrawn.
        requests: Vec<(bool, u32, bool)>,
        /// The rails' reports, every owed one once, in a shuffled order,
        /// with strays among them.
        reports: Vec<Report>,
    }

    fn case() -> impl Strategy<Value = Case> {
        (1usize..=4)
            .prop_flat_map(|rails| {
                prop::collection::vec(
                    (any::<bool>(), 1u32..(1 << rails), prop::bool::weighted(0.1)),
                    1..12,
                )
                .prop_flat_map(move |requests| {
                    let mut owed = Vec::new();
                    for (i, &(_, mask, _)) in requests.iter().enumerate() {
                        for r in 0..rails {
                            if mask & 1 << r != 0 {
                                owed.push((r, i as u64));
                            }
                        }
                    }
                    let n = owed.len();
                    let strays = prop::collection::vec((0..rails, 0u64..16), 0..6);
                    (
                        Just(requests),
                        Just(owed),
                        prop::collection::vec(any::<bool>(), n),
                        strays,
                        any::<u64>(),
                    )
                })
            })
            .prop_map(|(requests, owed, failed, strays, seed)| {
                let mut reports: Vec<Report> = owed
                    .into_iter()
                    .zip(failed)
                    .map(|((rail, id), failed)| Report { rail, id, failed })
                    .collect();
                // Strays: a rail that owes nothing for this id, an unknown
                // id, or a repeat.
                reports.extend(strays.into_iter().map(|(rail, id)| Report {
                    rail,
                    id,
                    failed: false,
                }));
                // A shuffle from the seed (Fisher-Yates over SplitMix64).
                let mut x = seed;
                for i in (1..reports.len()).rev() {
                    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
                    let mut z = x;
                    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    reports.swap(i, (z ^ (z >> 31)) as usize % (i + 1));
                }
                Case { requests, reports }
            })
    }

    proptest! {
        /// Every request is reported once, exactly when the last rail it
        /// owed a report to reported, never if withdrawn; a read fails iff
        /// a part failed, naming every block a failed part named; a lend
        /// finishes iff a rail's finished. Strays change nothing.
        #[test]
        fn each_request_is_reported_once_after_its_last_rail_and_strays_change_nothing(c in case()) {
            let mut fold = Fold::default();
            for (i, &(read, mask, withdrawn)) in c.requests.iter().enumerate() {
                let id = RequestId(i as u64);
                if read {
                    fold.begin_read(id, Read::new(mask, vec![Vec::new(); 4], Vec::new(), withdrawn));
                } else {
                    fold.begin_lend(id, Incarnation(i as u64 + 1), mask, withdrawn);
                }
            }
            let mut owed: Vec<u32> = c.requests.iter().map(|r| r.1).collect();
            let mut any_failed = vec![false; c.requests.len()];
            let mut blocks: Vec<Vec<BlockId>> = vec![Vec::new(); c.requests.len()];
            let mut reported = vec![0usize; c.requests.len()];
            let reason = Reason::of(Cause::Transfer);
            for rep in &c.reports {
                let i = rep.id as usize;
                let real = i < owed.len() && owed[i] & 1 << rep.rail != 0;
                let id = RequestId(rep.id);
                let named = [BlockId(rep.rail as u32 * 100 + rep.id as u32)];
                let read = i < owed.len() && c.requests[i].0;
                let lend_report = if i < owed.len() && !read {
                    let end = if rep.failed { LendEnd::Finished } else { LendEnd::Expired };
                    fold.lend_ended(rep.rail, id, end)
                } else {
                    None
                };
                let took = if read || i >= owed.len() {
                    let failure = rep.failed.then_some(reason);
                    Some(fold.part_ended(rep.rail, id, failure, &named))
                } else {
                    None
                };
                if !real {
                    prop_assert!(lend_report.is_none());
                    prop_assert!(matches!(took, None | Some(Took::Nothing)));
                    continue;
                }
                owed[i] &= !(1 << rep.rail);
                if rep.failed {
                    any_failed[i] = true;
                    blocks[i].push(named[0]);
                }
                let last = owed[i] == 0;
                let withdrawn = c.requests[i].2;
                if read {
                    match took {
                        Some(Took::Read(r)) => {
                            prop_assert!(last);
                            prop_assert_eq!(r.withdrawn, withdrawn);
                            reported[i] += usize::from(!r.withdrawn);
                            prop_assert_eq!(r.failure.is_some(), any_failed[i]);
                            let mut want = blocks[i].clone();
                            want.sort_unstable();
                            prop_assert_eq!(&r.invalid, &want);
                        }
                        Some(Took::Part) => prop_assert!(!last),
                        other => prop_assert!(false, "{:?}", other),
                    }
                } else {
                    match lend_report {
                        Some(rep) => {
                            prop_assert!(last && !withdrawn);
                            reported[i] += 1;
                            // `failed` stood for a finished rail lend.
                            let want = if any_failed[i] { LendReport::Finished } else { LendReport::Expired };
                            prop_assert_eq!(rep, want);
                        }
                        None => prop_assert!(!last || withdrawn),
                    }
                }
            }
            for (i, r) in c.requests.iter().enumerate() {
                prop_assert_eq!(reported[i], usize::from(!r.2), "request {}", i);
            }
            prop_assert_eq!(fold.len(), 0);
        }
    }
}
