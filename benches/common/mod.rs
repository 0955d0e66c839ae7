//! What the benches' two-thread measurements share.

/// Spins until `ready` gives a value. Every 1024th look yields instead:
/// where the machine has fewer free cores than spinning threads (CI's two),
/// the thread being waited for then still gets a core.
pub fn spin_until<T>(mut ready: impl FnMut() -> Option<T>) -> T {
    let mut looks = 0u32;
    loop {
        if let Some(v) = ready() {
            return v;
        }
        looks = looks.wrapping_add(1);
        if looks % 1024 == 0 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}
