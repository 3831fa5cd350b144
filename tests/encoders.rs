mod common;
use common::{bundled, data, trained_cache};

fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(a, b)| f64::from(a - b).powi(2)).sum();
    let den: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn measure() {
    for seed in 100..140u64 {
        for format in bundled() {
            let set = data(&format, seed * 7919 + 1, 2, 4, 300);
            let d = format.head_dim() as usize;
            for tier in 0..format.tiers().len() {
                let mut cache = trained_cache(&format, &set, seed);
                let s = cache.append_sequence(&set.keys, &set.values, |_| tier).unwrap();
                let (mut k, mut v) = (Vec::new(), Vec::new());
                for h in 0..2 {
                    let (a, b) = cache.decode_dense(s, h);
                    k.extend(a);
                    v.extend(b);
                }
                let _ = d;
                println!("{} {} keys {:.5} values {:.5}", format.name(), tier, rel(&k, &set.keys), rel(&v, &set.values));
            }
        }
    }
}
