use std::time::Duration;

/// Nearest-rank percentile; sorts in place.
pub fn percentile(samples: &mut [Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let rank = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}

/// The middle value (the upper one of an even count); sorts in place.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        assert_eq!(percentile(&mut v, 0.5), Duration::from_micros(50));
        assert_eq!(percentile(&mut v, 0.99), Duration::from_micros(99));
        assert_eq!(percentile(&mut [], 0.5), Duration::ZERO);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    }
}
