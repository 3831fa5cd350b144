//! Valid values to suggest when a spec's size does not fit: divisors near
//! the asked group size, listed as "16 or 32".

/// Two divisors of `n` nearest to `near` (one below and one above when possible),
/// restricted to `allowed` if given, as "16 or 32".
pub(super) fn divisor_suggestions(n: u32, near: u32, allowed: Option<&[u32]>) -> String {
    let divisors: Vec<u32> = divisors(n)
        .into_iter()
        .filter(|d| allowed.is_none_or(|a| a.contains(d)))
        .collect();
    let below = divisors.iter().rev().find(|&&d| d < near).copied();
    let above = divisors.iter().find(|&&d| d > near).copied();
    let mut picks: Vec<u32> = match (below, above) {
        (Some(b), Some(a)) => vec![b, a],
        (Some(b), None) => {
            let mut low: Vec<u32> = divisors
                .iter()
                .rev()
                .filter(|&&d| d <= b)
                .take(2)
                .copied()
                .collect();
            low.reverse();
            low
        }
        (None, Some(a)) => divisors
            .iter()
            .filter(|&&d| d >= a)
            .take(2)
            .copied()
            .collect(),
        (None, None) => divisors.clone(),
    };
    picks.dedup();
    or_list(&picks)
}

/// The divisors of `n`, ascending: each trial divisor up to √n gives its
/// pair, so a head_dim or rank near 2³¹ costs 46,340 trials, not 2³¹.
fn divisors(n: u32) -> Vec<u32> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    for d in trial_divisors(n).filter(|&d| n.is_multiple_of(d)) {
        low.push(d);
        if d != n / d {
            high.push(n / d);
        }
    }
    low.extend(high.into_iter().rev());
    low
}

fn trial_divisors(n: u32) -> std::ops::RangeInclusive<u32> {
    1..=n.isqrt()
}

/// "1", "1 or 2", "1, 2 or 4".
pub(super) fn or_list(values: &[u32]) -> String {
    let words: Vec<String> = values.iter().map(u32::to_string).collect();
    match words.len() {
        0 => String::from("(none)"),
        1 => words[0].clone(),
        k => format!("{} or {}", words[..k - 1].join(", "), words[k - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_come_from_trials_up_to_the_square_root() {
        for n in 1..=2000u32 {
            let scan: Vec<u32> = (1..=n).filter(|&d| n.is_multiple_of(d)).collect();
            assert_eq!(divisors(n), scan, "{n}");
        }
        assert_eq!(divisors(i32::MAX as u32), [1, i32::MAX as u32]);
        assert_eq!(trial_divisors(i32::MAX as u32).count(), 46_340);
        assert_eq!(trial_divisors(u32::MAX).count(), 65_535);
        assert_eq!(
            divisor_suggestions(i32::MAX as u32, 64, None),
            "1 or 2147483647"
        );
    }
}
