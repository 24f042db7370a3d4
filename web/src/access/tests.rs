use super::*;

#[test]
fn authorities_are_parsed_strictly() {
    assert_eq!(split_authority("LocalHost:7878"), Some(("localhost".into(), Some(7878))));
    assert_eq!(split_authority("[::1]:80"), Some(("[::1]".into(), Some(80))));
    assert_eq!(split_authority("[::1]"), Some(("[::1]".into(), None)));
    assert_eq!(split_authority("example.com."), Some(("example.com".into(), None)));
    for bad in ["", ":80", "a b:1", "evil.com:x", "[::1", "[zz]:1", "a:99999", "::1", "a/b"] {
        assert_eq!(split_authority(bad), None, "{bad:?}");
    }
}

#[test]
fn hosts_follow_the_bind() {
    let lo = Access::for_bound(([127, 0, 0, 1], 7878).into(), &[], false).expect("access");
    assert!(lo.check_host("localhost:7878").is_some());
    assert!(lo.check_host("[::1]:7878").is_some());
    assert!(lo.check_host("127.0.0.1:7879").is_none(), "another port");
    assert!(lo.check_host("evil.example:7878").is_none(), "a rebound name");
    assert!(lo.check_host("192.168.1.5:7878").is_none());

    let any = Access::for_bound(([0, 0, 0, 0], 7878).into(), &["dash.example.com".into()], false).expect("access");
    assert!(any.check_host("192.168.1.5:7878").is_some(), "an address of a wildcard bind");
    assert!(any.check_host("dash.example.com:7878").is_some());
    assert!(any.check_host("dash.example.com:7000").is_none());
    assert!(any.check_host("evil.example:7878").is_none());

    let web = Access::for_bound(([0, 0, 0, 0], 80).into(), &[], false).expect("access");
    assert!(web.check_host("localhost").is_some(), "no port means the scheme's");
}

#[test]
fn origins_must_be_the_servers_own() {
    let a = Access::for_bound(([127, 0, 0, 1], 7878).into(), &[], false).expect("access");
    let host = a.check_host("localhost:7878").expect("host");
    assert!(a.origin_allowed("http://localhost:7878", &host));
    assert!(!a.origin_allowed("http://localhost:8888", &host), "another local app");
    assert!(!a.origin_allowed("http://127.0.0.1:7878", &host), "another origin, even if ours");
    assert!(!a.origin_allowed("null", &host));
    assert!(!a.origin_allowed("https://evil.example", &host));
    let b = Access::for_bound(([127, 0, 0, 1], 7878).into(), &["proxy.example:443".into()], false).expect("access");
    assert!(b.origin_allowed("https://proxy.example", &host));
}

#[test]
fn the_token_comes_by_header_or_query_never_by_cookie() {
    let a = Access::for_bound(([127, 0, 0, 1], 7878).into(), &[], false)
        .and_then(|a| a.with_token("0123456789abcdef"))
        .expect("access");
    let mut h = HeaderMap::new();
    assert_eq!(a.presented(&h, None), None);
    assert_eq!(a.presented(&h, Some("x=1&token=0123456789abcdef")), Some(Presented::Query));
    assert_eq!(a.presented(&h, Some("token=0123456789abcdeX")), None);
    // A cookie could come from any port of the host: it is never taken.
    for cookie in ["stagehand_token_7878=0123456789abcdef", "__Host-stagehand_token=0123456789abcdef", "token=0123456789abcdef"] {
        h.insert(header::COOKIE, HeaderValue::from_static(cookie));
        assert_eq!(a.presented(&h, None), None, "{cookie}");
    }
    h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer 0123456789abcdef"));
    assert_eq!(a.presented(&h, None), Some(Presented::Header));
    assert_eq!(query_without_token("a=1&token=x&b=2"), "a=1&b=2");
    assert!(format!("{a:?}").contains("redacted") && !format!("{a:?}").contains("0123456789abcdef"));
}
