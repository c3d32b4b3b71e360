//! One backend's verdict from its probes' results, sans I/O: `passes` passes in a row make it
//! up, `fails` failures in a row down; until either, it has none ([`Verdict::Unknown`]).

use ringmux_ring::health::Verdict;

/// A backend's verdict and the results in a row that lead to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracker {
    verdict: Verdict,
    /// The last result (a pass?) and how many in a row, at most 255.
    last: bool,
    in_a_row: u8,
}

impl Default for Tracker {
    fn default() -> Self {
        Tracker {
            verdict: Verdict::Unknown,
            last: false,
            in_a_row: 0,
        }
    }
}

impl Tracker {
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// One probe's result: the new verdict when it changed.
    pub fn observe(&mut self, passed: bool, passes: u8, fails: u8) -> Option<Verdict> {
        match self.in_a_row != 0 && self.last == passed {
            true => self.in_a_row = self.in_a_row.saturating_add(1),
            false => (self.last, self.in_a_row) = (passed, 1),
        }
        let (to, needed) = match passed {
            true => (Verdict::Up, passes.max(1)),
            false => (Verdict::Down, fails.max(1)),
        };
        if self.verdict == to || self.in_a_row < needed {
            return None;
        }
        self.verdict = to;
        Some(to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `results` (`+` a pass, `-` a failure) and writes the verdict after each.
    fn run(passes: u8, fails: u8, results: &str) -> String {
        let mut t = Tracker::default();
        results
            .chars()
            .map(|c| {
                t.observe(c == '+', passes, fails);
                match t.verdict() {
                    Verdict::Unknown => '?',
                    Verdict::Up => 'U',
                    Verdict::Down => 'D',
                }
            })
            .collect()
    }

    #[test]
    fn one_result_flips_with_the_defaults() {
        assert_eq!(run(1, 1, "+-+--+"), "UDUDDU");
        assert_eq!(run(1, 1, "-"), "D");
    }

    #[test]
    fn results_in_a_row_flip_only_together() {
        assert_eq!(run(2, 3, "+-+-"), "????", "never two alike in a row");
        assert_eq!(run(2, 3, "++--+---"), "?UUUUUUD");
        assert_eq!(run(2, 3, "---+-++"), "??DDDDU");
    }

    #[test]
    fn a_change_is_reported_once() {
        let mut t = Tracker::default();
        assert_eq!(t.observe(false, 1, 2), None);
        assert_eq!(t.observe(false, 1, 2), Some(Verdict::Down));
        for _ in 0..300 {
            assert_eq!(
                t.observe(false, 1, 2),
                None,
                "no overflow past 255 in a row"
            );
        }
        assert_eq!(t.observe(true, 1, 2), Some(Verdict::Up));
    }
}
