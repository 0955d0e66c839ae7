//! Pinning: the chosen CPU is read back; a failure is an error for `busy`
//! and a warning for `adaptive`. Each test pins a thread of its own, so the
//! test harness's threads keep their affinity.

use std::thread;

use kvpoll::placement::{current_affinity, pin_current_thread, IdlePolicy, PlacementError};

fn on_new_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    thread::spawn(f).join().unwrap()
}

#[test]
fn pinning_to_an_allowed_cpu_reads_back_exactly_that_cpu() {
    let allowed = current_affinity().unwrap();
    let cpu = *allowed.last().unwrap();
    let outcome = on_new_thread(move || pin_current_thread(cpu, IdlePolicy::Adaptive)).unwrap();
    assert_eq!(outcome.core, cpu);
    assert_eq!(outcome.affinity, vec![cpu]);
    assert_eq!(outcome.running_on, Some(cpu));
    assert_eq!(outcome.warning, None);
    assert!(outcome.is_pinned());
}

#[test]
fn pinning_a_busy_poller_to_a_missing_cpu_is_an_error() {
    // CPU 1000 fits a cpu_set_t but no machine this runs on has it.
    let err = on_new_thread(|| pin_current_thread(1000, IdlePolicy::Busy)).unwrap_err();
    assert!(
        matches!(err, PlacementError::Pin { core: 1000, .. }),
        "{err:?}"
    );
}

#[test]
fn pinning_an_adaptive_poller_to_a_missing_cpu_warns_and_keeps_running() {
    let before = current_affinity().unwrap();
    let (outcome, after) = on_new_thread(|| {
        let outcome = pin_current_thread(1000, IdlePolicy::Adaptive);
        (outcome, current_affinity())
    });
    let outcome = outcome.unwrap();
    assert!(!outcome.is_pinned());
    assert!(
        outcome.warning.as_deref().unwrap().contains("CPU 1000"),
        "{outcome:?}"
    );
    // The failed call left the thread where it was.
    assert_eq!(after.unwrap(), before);
}

#[test]
fn pinning_beyond_the_kernel_cpu_set_is_an_error_not_a_panic() {
    let err = on_new_thread(|| pin_current_thread(1 << 20, IdlePolicy::Busy)).unwrap_err();
    assert!(
        err.to_string().contains("beyond the kernel's CPU set size"),
        "{err}"
    );
}
