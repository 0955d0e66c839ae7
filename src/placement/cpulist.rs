//! Linux CPU lists (`0-3,8,10-11`), as `/sys` and the kernel command line
//! write them.

/// Parses a CPU list such as `0-3,8,10-11`. Empty text (or only
/// whitespace) is the empty list. Returns the CPUs sorted and deduplicated.
///
/// ```
/// use kvpoll::placement::parse_cpu_list;
/// assert_eq!(parse_cpu_list("0-2,8").unwrap(), vec![0, 1, 2, 8]);
/// assert!(parse_cpu_list("3-1").is_err());
/// ```
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in text
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        // The kernel also allows `a-b:step/group`; kvpoll only reads plain ranges.
        let number = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| format!("{s:?} in CPU list {text:?} is not a CPU number"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if a > b {
                    return Err(format!(
                        "range {part:?} in CPU list {text:?} runs backwards"
                    ));
                }
                // Bound the range so a corrupt file cannot make us allocate wildly.
                if b - a > 1 << 16 {
                    return Err(format!("range {part:?} in CPU list {text:?} is too large"));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(number(part)?),
        }
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Formats CPUs as a compact CPU list (`0-3,8`); `(none)` when empty.
///
/// ```
/// use kvpoll::placement::format_cpu_list;
/// assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8]), "0-3,8");
/// ```
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    if parts.is_empty() {
        "(none)".to_owned()
    } else {
        parts.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_list_round_trips_ranges_and_singles() {
        let cpus = parse_cpu_list(" 0-3, 8,10-11\n").unwrap();
        assert_eq!(cpus, vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(format_cpu_list(&cpus), "0-3,8,10-11");
    }

    #[test]
    fn cpu_list_rejects_words_and_backward_ranges() {
        assert!(parse_cpu_list("0,x").is_err());
        assert!(parse_cpu_list("5-2").is_err());
        assert_eq!(parse_cpu_list("").unwrap(), Vec::<usize>::new());
    }
}
